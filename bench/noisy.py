"""Noisy neighbour: a quiet tenant's Remember and search while another tenant floods the model.

    .venv/bin/python -m bench.noisy [--calls 20] [--flood-calls 3] [--flood-items 32]

On the embedded PostgreSQL and the embedded default model (multilingual-e5-small), one in-process
tokensvc over mTLS. The quiet tenant (namespace `default`, the dev launcher) remembers one short
sentence and searches it, `--calls` times each, one at a time. Measured in the same run:

- the quiet tenant alone;
- the same while a launcher of another namespace keeps `--flood-calls` Remembers of
  `--flood-items` 8 KiB memories in flight (a new one as each finishes) and its control plane
  uploads a document, so the model never idles;
- the flood's own rate (texts embedded per second) while it shares the model.

The ratios (with over without the flood) are what the scheduler bounds: a quiet call waits for the
slices already running, about one model batch per thread, never for the flood's queue. Results go
to bench/results/noisy.json.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.client import mtls_channel
from bench.env import bench_env
from bench.stats import latency_summary, percentile
from tokensvc.auth.devpki import issue_client_certificate
from tokensvc.embedders.registry import DEFAULT_EMBEDDER
from tokensvc.v1 import knowledge_pb2, knowledge_pb2_grpc, memory_pb2, memory_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
FLOOD_NAMESPACE, FLOOD_AGENT = "flood", "bulk-writer"


def log(message: str) -> None:
    print(f"[noisy {time.strftime('%H:%M:%S')}] {message}", flush=True)


def essay(rng: random.Random, chars: int) -> str:
    """Distinct prose-like text (so nothing is deduplicated) of `chars` characters."""
    words: list[str] = []
    used = 0
    while used < chars:
        words.append(f"topic{rng.randrange(5000)}")
        used += len(words[-1]) + 1
    return " ".join(words)[:chars]


@dataclass
class Tenants:
    """The quiet launcher, the flooding launcher and the flood's control plane, over mTLS."""

    quiet: memory_pb2_grpc.MemoryServiceStub
    quiet_auth: tuple[tuple[str, str], ...]
    flood: memory_pb2_grpc.MemoryServiceStub
    flood_auth: tuple[tuple[str, str], ...]
    knowledge: knowledge_pb2_grpc.KnowledgeServiceStub
    notes: Iterator[int] = field(default_factory=itertools.count)


async def quiet_round(tenants: Tenants, calls: int) -> tuple[list[float], list[float]]:
    """`calls` one-sentence Remembers, each followed by a search; their latencies in ms."""
    remembers, searches = [], []
    for _ in range(calls):
        n = next(tenants.notes)
        note = memory_pb2.RememberItem(content=f"Note {n}: the review of service {n % 13} is due.")
        t0 = time.perf_counter()
        await tenants.quiet.Remember(
            memory_pb2.RememberRequest(items=[note]), metadata=tenants.quiet_auth, timeout=600
        )
        remembers.append((time.perf_counter() - t0) * 1000)
        search = memory_pb2.SearchMemoriesRequest(query_text=f"when is review {n % 13} due", top_k=5)
        t0 = time.perf_counter()
        await tenants.quiet.SearchMemories(search, metadata=tenants.quiet_auth, timeout=600)
        searches.append((time.perf_counter() - t0) * 1000)
    return remembers, searches


async def flood_writer(tenants: Tenants, rng: random.Random, items: int, stop: asyncio.Event) -> int:
    """Large Remembers, one after another, until `stop`; the texts it had embedded."""
    embedded = 0
    while not stop.is_set():
        request = memory_pb2.RememberRequest(
            items=[memory_pb2.RememberItem(content=essay(rng, 8192)) for _ in range(items)]
        )
        await tenants.flood.Remember(request, metadata=tenants.flood_auth, timeout=1800)
        embedded += items
    return embedded


async def flood_upload(tenants: Tenants, rng: random.Random) -> None:
    """A 60 KB Markdown handbook into a knowledge base of the flooding namespace."""
    await tenants.knowledge.CreateKnowledgeBase(
        knowledge_pb2.CreateKnowledgeBaseRequest(
            namespace=FLOOD_NAMESPACE,
            ref="handbook",
            embedder=DEFAULT_EMBEDDER,
            chunking=knowledge_pb2.ChunkingStrategy(kind=knowledge_pb2.CHUNKING_KIND_MARKDOWN),
        ),
        timeout=60,
    )
    document = "\n\n".join(f"# Part {i}\n\n{essay(rng, 1500)}" for i in range(40)).encode()
    header = knowledge_pb2.UploadDocumentHeader(
        namespace=FLOOD_NAMESPACE,
        knowledge_base_ref="handbook",
        document_ref="guide.md",
        content_type="text/markdown",
        wait_until_ready=True,
    )
    messages = [
        knowledge_pb2.UploadDocumentRequest(header=header),
        knowledge_pb2.UploadDocumentRequest(content=document),
    ]
    await tenants.knowledge.UploadDocument(iter(messages), timeout=1800)


async def measure(tenants: Tenants, calls: int, flood_calls: int, flood_items: int) -> dict[str, Any]:
    log("warming the model and both memory spaces")
    await quiet_round(tenants, calls)
    warm = memory_pb2.RememberRequest(items=[memory_pb2.RememberItem(content="warm")])
    await tenants.flood.Remember(warm, metadata=tenants.flood_auth, timeout=600)
    log(f"the quiet tenant alone: {calls} Remembers and searches")
    alone = await quiet_round(tenants, calls)

    rng, stop = random.Random(7), asyncio.Event()
    log(f"the flood: {flood_calls} Remembers of {flood_items} x 8 KiB in flight, and an upload")
    began = time.perf_counter()
    writers = [
        asyncio.ensure_future(flood_writer(tenants, rng, flood_items, stop)) for _ in range(flood_calls)
    ]
    upload = asyncio.ensure_future(flood_upload(tenants, rng))
    await asyncio.sleep(2.0)  # the flood's first slices hold the model
    log(f"the quiet tenant under the flood: {calls} Remembers and searches")
    shared = await quiet_round(tenants, calls)
    stop.set()
    embedded = sum(await asyncio.gather(*writers))
    await upload
    flood_seconds = time.perf_counter() - began

    def ratios(with_flood: list[float], without: list[float]) -> dict[str, float]:
        return {
            "p50": round(percentile(with_flood, 50) / percentile(without, 50), 2),
            "p99": round(percentile(with_flood, 99) / percentile(without, 99), 2),
        }

    return {
        "calls": calls,
        "flood": {"calls_in_flight": flood_calls, "items_per_call": flood_items, "item_chars": 8192},
        "remember_alone": latency_summary(alone[0]),
        "remember_with_flood": latency_summary(shared[0]),
        "search_alone": latency_summary(alone[1]),
        "search_with_flood": latency_summary(shared[1]),
        "remember_with_over_alone": ratios(shared[0], alone[0]),
        "search_with_over_alone": ratios(shared[1], alone[1]),
        "flood_texts_per_s": round(embedded / flood_seconds, 2),
        "flood_seconds": round(flood_seconds, 1),
    }


async def run(calls: int, flood_calls: int, flood_items: int) -> dict[str, Any]:
    async with bench_env() as env:
        # Connections live through the whole run: a recycled one (every 300 s by default) would cut
        # the flood's minutes-long Remembers, which measures the recycling, not the schedule.
        service = await env.start_service(memory_embedder=DEFAULT_EMBEDDER, max_connection_age_seconds=3600)
        ca = env.dev.ca_cert.read_bytes()
        flood_id = f"spiffe://dev.local/ns/{FLOOD_NAMESPACE}/sa/{FLOOD_AGENT}"
        certificates = {
            "quiet": env.dev.client("launcher"),
            "flood": issue_client_certificate(env.dev, flood_id, env.root, name="flood"),
            "control": env.dev.client("control-plane"),
        }
        channels = {
            who: mtls_channel(service.port, ca, cert.read_bytes(), key.read_bytes())
            for who, (cert, key) in certificates.items()
        }
        flood_token = env.capability(namespace=FLOOD_NAMESPACE, agent=FLOOD_AGENT, long_term_memory=True)
        tenants = Tenants(
            quiet=memory_pb2_grpc.MemoryServiceStub(channels["quiet"]),
            quiet_auth=(("authorization", f"Bearer {env.capability(long_term_memory=True)}"),),
            flood=memory_pb2_grpc.MemoryServiceStub(channels["flood"]),
            flood_auth=(("authorization", f"Bearer {flood_token}"),),
            knowledge=knowledge_pb2_grpc.KnowledgeServiceStub(channels["control"]),
        )
        try:
            results = await measure(tenants, calls, flood_calls, flood_items)
        finally:
            for channel in channels.values():
                await channel.close(grace=None)
    log(json.dumps(results))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--calls", type=int, default=40, help="quiet Remembers and searches (default %(default)s)"
    )
    parser.add_argument(
        "--flood-calls", type=int, default=3, help="flood Remembers in flight (default %(default)s)"
    )
    parser.add_argument(
        "--flood-items", type=int, default=32, help="memories per flood Remember (default %(default)s)"
    )
    args = parser.parse_args()
    results = asyncio.run(run(args.calls, args.flood_calls, args.flood_items))
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "noisy.json"
    out.write_text(json.dumps(results, indent=1) + "\n")
    log(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
