"""Knowledge-base retrieval quality: does SearchKnowledge return the passage that answers a question?

    .venv/bin/python -m bench.knowledge_quality [--strategy S]... [--mode M]... [--set SETTING=VALUE]...

The corpus is tokensvc's own documentation; the questions are hand-written (bench/kb_questions.toml),
each naming its document and an exact passage of it (`answer`) that holds the answer. Per chunking
strategy (fixed, recursive, markdown) one knowledge base is created with the server's default
embedder, and every document is uploaded as text/markdown. Then, per search mode (vector, text,
hybrid), every question is asked through SearchKnowledge (top_k = 5) over mTLS with a launcher
capability, and the metrics are:

- hit@1 / hit@5: the share of questions whose *known chunk* is the first passage / among the five;
- mrr@5: the mean of 1/rank of the known chunk (0 when it is not in the five);
- text_ranked: the share of questions where the full-text ranker ranked any returned passage (a
  HYBRID search whose text side matches nothing is just the vector ranking);
- the same hit rates by question style (paraphrase or keyword) and by document.

The known chunk is the chunk holding the first character of the answer. It comes from the domain
chunker itself (`extract_text`, then `chunk_document` with the knowledge base's pinned strategy),
which is what the server stores: the benchmark checks that every document's chunk count equals the
upload's `chunk_count`, and that every returned passage's text is that local chunk's text. Answers
that run past the end of their chunk (they straddle a chunk boundary) are listed per strategy.

Chunks are the server's default size (256 words) without overlap unless `--chunk-size`/`--overlap`
say otherwise. A mode this checkout's protos lack (SEARCH_MODE_TEXT before it exists) is skipped
with a note. `run_knowledge_quality(env)` measures against an already running `bench.env`
service, as `bench.run` could; alone, the command starts its own world and writes
bench/results/knowledge-quality.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc

from bench.client import mtls_channel
from bench.env import NAMESPACE, BenchEnv, bench_env
from bench.questions import (
    CONTENT_TYPE,
    QUESTIONS,
    Question,
    Span,
    load_documents,
    load_questions,
    locate_all,
)
from tokensvc.knowledge.chunking import Chunk, ChunkingKind, ChunkingStrategy, chunk_document
from tokensvc.v1 import common_pb2, knowledge_pb2, knowledge_pb2_grpc

__all__ = ["Question", "load_questions", "main", "run_knowledge_quality"]

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
OUTPUT = RESULTS / "knowledge-quality.json"

TOP_K = 5
CONCURRENCY = 8
TIMEOUT = 60.0
UPLOAD_TIMEOUT = 600.0
PIECE = 1 << 20  # upload content pieces (the recommended 1 MiB)
ATTEMPTS = 3

MODES = ("vector", "text", "hybrid")
STRATEGIES = tuple(kind.value for kind in ChunkingKind)
# Enum value names in common_pb2; SEARCH_MODE_TEXT may not exist yet in a given checkout.
MODE_ENUM = {"vector": "SEARCH_MODE_VECTOR", "text": "SEARCH_MODE_TEXT", "hybrid": "SEARCH_MODE_HYBRID"}
KIND_ENUM = {
    ChunkingKind.FIXED: knowledge_pb2.CHUNKING_KIND_FIXED,
    ChunkingKind.RECURSIVE: knowledge_pb2.CHUNKING_KIND_RECURSIVE,
    ChunkingKind.MARKDOWN: knowledge_pb2.CHUNKING_KIND_MARKDOWN,
}
_UNSAFE_REF_CHARS = re.compile(r"[\s#\x00-\x1f\x7f]")
_T = TypeVar("_T")


def log(message: str) -> None:
    print(f"[kb-quality {time.strftime('%H:%M:%S')}] {message}", flush=True)


# --- questions and where their answers are ----------------------------------------------------------


def doc_ref(name: str) -> str:
    """A valid document ref for a file name: no whitespace, control characters or '#'."""
    return _UNSAFE_REF_CHARS.sub("-", name)[:512]


# --- known chunks per strategy ----------------------------------------------------------------------


@dataclass(frozen=True)
class Resolution:
    """Per question the citations of the chunks holding its answer's start, and the straddlers."""

    known: dict[int, frozenset[str]]
    straddling: list[dict[str, Any]]


def citation(doc: str, index: int) -> str:
    return f"{doc_ref(doc)}#{index}"


def resolve(
    questions: Sequence[Question], spans: dict[int, Span], chunks: dict[str, list[Chunk]]
) -> Resolution:
    """The chunk(s) whose span holds each answer's first character (several only with overlap)."""
    known: dict[int, frozenset[str]] = {}
    straddling = []
    for q in questions:
        span = spans[q.number]
        holders = [c for c in chunks[q.doc] if c.start <= span.start < c.end]
        if not holders:
            raise AssertionError(f"question {q.number}: no chunk holds offset {span.start} of {q.doc}")
        known[q.number] = frozenset(citation(q.doc, c.index) for c in holders)
        if not any(c.end >= span.end for c in holders):
            touched = [c.index for c in chunks[q.doc] if c.start < span.end and span.start < c.end]
            straddling.append({"question": q.number, "doc": q.doc, "chunks": touched})
    return Resolution(known, straddling)


# --- the service ----------------------------------------------------------------------------------


@dataclass
class Clients:
    """The control plane's and a launcher's view of one running tokensvc."""

    manager: knowledge_pb2_grpc.KnowledgeServiceAsyncStub
    searcher: knowledge_pb2_grpc.KnowledgeServiceAsyncStub
    channels: tuple[grpc.aio.Channel, ...]

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close(grace=None)


def open_clients(env: BenchEnv) -> Clients:
    assert env.service is not None, "start the service first"
    ca = env.dev.ca_cert.read_bytes()
    channels = []
    for role in ("control-plane", "launcher"):
        cert, key = env.dev.client(role)
        channels.append(mtls_channel(env.service.port, ca, cert.read_bytes(), key.read_bytes()))
    manager, searcher = (knowledge_pb2_grpc.KnowledgeServiceStub(channel) for channel in channels)
    return Clients(manager, searcher, tuple(channels))


def capability(env: BenchEnv, refs: Sequence[str]) -> str:
    """A launcher capability (the dev launcher's agent) whose roster is `refs`."""
    return env.capability(knowledge_bases=list(refs), ttl_seconds=3600)


async def create_base(clients: Clients, ref: str, strategy: ChunkingStrategy) -> knowledge_pb2.KnowledgeBase:
    """A knowledge base with `strategy` and the server's default embedder (`embedder` empty)."""
    request = knowledge_pb2.CreateKnowledgeBaseRequest(
        namespace=NAMESPACE,
        ref=ref,
        embedder="",
        chunking=knowledge_pb2.ChunkingStrategy(
            kind=KIND_ENUM[strategy.kind],
            chunk_size=strategy.chunk_size,
            chunk_overlap=strategy.chunk_overlap,
        ),
    )
    response = await clients.manager.CreateKnowledgeBase(request, timeout=TIMEOUT)
    return response.knowledge_base


async def retrying(call: Callable[[], Awaitable[_T]]) -> _T:
    """`call()`, again on UNAVAILABLE: a connection recycled at `max_connection_age_seconds` cuts
    the calls still running after a short grace (the bench service's is 1 s). Only for calls that
    are safe to repeat: an upload of the same bytes is `unchanged`, a search reads."""
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return await call()
        except grpc.aio.AioRpcError as error:
            if error.code() is not grpc.StatusCode.UNAVAILABLE or attempt == ATTEMPTS:
                raise
            log(f"retrying after UNAVAILABLE ({error.details()})")
    raise AssertionError("unreachable")


async def upload(
    clients: Clients,
    kb_ref: str,
    name: str,
    text: str | bytes,
    content_type: str = CONTENT_TYPE,
    metadata: dict[str, str] | None = None,
) -> int:
    """Upload one document (its text as text/markdown, or its bytes as `content_type`) with string
    `metadata` and wait until it is READY; the chunk count the server reports."""
    content = text.encode("utf-8") if isinstance(text, str) else text
    header = knowledge_pb2.UploadDocumentHeader(
        namespace=NAMESPACE,
        knowledge_base_ref=kb_ref,
        document_ref=doc_ref(name),
        content_type=content_type,
        metadata={k: common_pb2.MetadataValue(string_value=v) for k, v in (metadata or {}).items()},
        wait_until_ready=True,
    )
    messages = [knowledge_pb2.UploadDocumentRequest(header=header)]
    messages += [
        knowledge_pb2.UploadDocumentRequest(content=content[i : i + PIECE])
        for i in range(0, len(content), PIECE)
    ]
    response = await retrying(lambda: clients.manager.UploadDocument(iter(messages), timeout=UPLOAD_TIMEOUT))
    return int(response.chunk_count)


async def search(
    clients: Clients,
    token: str,
    kb_ref: str,
    query: str,
    mode: int,
    filter_: common_pb2.Filter | None = None,
) -> tuple[list[knowledge_pb2.Passage], float]:
    """The top passages of one knowledge base for `query` (among the documents `filter_` keeps),
    and the call's latency in ms."""
    request = knowledge_pb2.SearchKnowledgeRequest(
        knowledge_base_refs=[kb_ref],
        query_text=query,
        top_k=TOP_K,
        mode=common_pb2.SearchMode.ValueType(mode),
        filter=filter_,
    )
    metadata = (("authorization", f"Bearer {token}"),)
    began = time.perf_counter()
    response = await retrying(
        lambda: clients.searcher.SearchKnowledge(request, metadata=metadata, timeout=TIMEOUT)
    )
    return list(response.passages), (time.perf_counter() - began) * 1000


# --- scoring ----------------------------------------------------------------------------------------


def rank_of(passages: Sequence[knowledge_pb2.Passage], known: frozenset[str]) -> int | None:
    """1-based rank of the first passage citing a known chunk, or None."""
    for rank, passage in enumerate(passages, start=1):
        if passage.citation in known:
            return rank
    return None


def metrics(ranks: Sequence[int | None]) -> dict[str, Any]:
    n = len(ranks)
    if n == 0:
        return {"hit@1": None, "hit@5": None, "mrr@5": None, "n": 0}
    return {
        "hit@1": round(sum(r == 1 for r in ranks) / n, 3),
        "hit@5": round(sum(r is not None for r in ranks) / n, 3),
        "mrr@5": round(sum(1 / r for r in ranks if r is not None) / n, 3),
        "n": n,
    }


def grouped(questions: Sequence[Question], ranks: dict[int, int | None], key: str) -> dict[str, Any]:
    groups: dict[str, list[int | None]] = {}
    for q in questions:
        groups.setdefault(getattr(q, key), []).append(ranks[q.number])
    return {name: metrics(values) for name, values in sorted(groups.items())}


def check_passages(passages: Sequence[knowledge_pb2.Passage], texts: dict[str, str]) -> None:
    """Every returned passage is exactly the locally chunked text it cites."""
    for passage in passages:
        if texts.get(passage.citation) != passage.text:
            raise AssertionError(f"passage {passage.citation} differs from the local chunker's chunk")


@dataclass(frozen=True)
class Answered:
    """One question's outcome: the known chunk's rank (None: not in the top k)."""

    rank: int | None
    latency_ms: float
    text_ranked: bool  # some passage carries a full-text rank


async def measure_mode(
    clients: Clients,
    token: str,
    kb_ref: str,
    mode: int,
    questions: Sequence[Question],
    resolution: Resolution,
    texts: dict[str, str],
) -> dict[str, Any]:
    """Every question against one knowledge base in one mode: the metrics and the misses."""
    gate = asyncio.Semaphore(CONCURRENCY)

    async def ask(q: Question) -> Answered:
        async with gate:
            passages, latency = await search(clients, token, kb_ref, q.question, mode)
        check_passages(passages, texts)
        text_ranked = any(p.text_rank > 0 for p in passages)
        return Answered(rank_of(passages, resolution.known[q.number]), latency, text_ranked)

    answered = await asyncio.gather(*(ask(q) for q in questions))
    ranks = {q.number: a.rank for q, a in zip(questions, answered, strict=True)}
    latencies = [a.latency_ms for a in answered]
    return {
        **metrics(list(ranks.values())),
        # HYBRID only: questions where the full-text ranker placed any of the returned passages.
        "text_ranked": round(sum(a.text_ranked for a in answered) / len(answered), 3),
        "by_style": grouped(questions, ranks, "style"),
        "by_doc": grouped(questions, ranks, "doc"),
        "missed@5": [number for number, rank in ranks.items() if rank is None],
        "latency_ms_p50": round(statistics.median(latencies), 1),
    }


def search_modes(modes: Sequence[str]) -> tuple[dict[str, int], dict[str, str]]:
    """The proto enum value per requested mode, and a note per mode this checkout lacks."""
    values, skipped = {}, {}
    for mode in modes:
        if mode not in MODE_ENUM:
            raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
        value = getattr(common_pb2, MODE_ENUM[mode], None)
        if value is None:
            skipped[mode] = f"common_pb2 has no {MODE_ENUM[mode]} (not generated yet)"
        else:
            values[mode] = int(value)
    return values, skipped


# --- one strategy end to end --------------------------------------------------------------------


@dataclass(frozen=True)
class Base:
    """One knowledge base built for a strategy, with the local view of its chunks."""

    strategy: ChunkingStrategy
    ref: str
    embedder: str
    chunks: dict[str, list[Chunk]]
    resolution: Resolution
    upload_s: float

    @property
    def texts(self) -> dict[str, str]:
        return {citation(doc, c.index): c.text for doc, chunks in self.chunks.items() for c in chunks}


async def build_base(
    clients: Clients,
    strategy: ChunkingStrategy,
    documents: dict[str, str],
    questions: Sequence[Question],
    spans: dict[int, Span],
) -> Base:
    """Create the knowledge base, upload every document and check the server chunked as we do."""
    ref = f"kbq-{strategy.kind.value}-{uuid.uuid4().hex[:8]}"
    created = await create_base(clients, ref, strategy)
    chunks = {name: chunk_document(text, strategy) for name, text in documents.items()}
    began = time.perf_counter()
    for name, text in documents.items():
        stored = await upload(clients, ref, name, text)
        if stored != len(chunks[name]):
            raise AssertionError(
                f"{strategy.kind.value}: the server cut {name} into {stored} chunks, the local chunker"
                f" into {len(chunks[name])}; the known chunks would be wrong"
            )
    upload_s = time.perf_counter() - began
    return Base(strategy, ref, created.embedder, chunks, resolve(questions, spans, chunks), upload_s)


async def measure_base(
    clients: Clients,
    token: str,
    base: Base,
    modes: dict[str, int],
    questions: Sequence[Question],
) -> dict[str, Any]:
    texts = base.texts
    results = {}
    for name, value in modes.items():
        log(f"{base.strategy.kind.value}: {len(questions)} questions, {name} mode")
        try:
            results[name] = await measure_mode(
                clients, token, base.ref, value, questions, base.resolution, texts
            )
        except grpc.aio.AioRpcError as error:
            if error.code() is not grpc.StatusCode.INVALID_ARGUMENT:
                raise
            # A mode this server does not accept (yet): reported, not fatal.
            results[name] = {"error": f"{error.code().name}: {error.details()}"}
    return {
        "knowledge_base": base.ref,
        "embedder": base.embedder,
        "chunk_size": base.strategy.chunk_size,
        "chunk_overlap": base.strategy.chunk_overlap,
        "chunks": sum(len(chunks) for chunks in base.chunks.values()),
        "chunks_by_doc": {name: len(chunks) for name, chunks in base.chunks.items()},
        "upload_s": round(base.upload_s, 2),
        "straddling": base.resolution.straddling,
        "modes": results,
    }


async def run_knowledge_quality(
    env: BenchEnv,
    *,
    modes: Sequence[str] = ("vector", "text", "hybrid"),
    strategies: Sequence[str] = ("fixed", "recursive", "markdown"),
    chunk_size: int = 0,
    chunk_overlap: int = 0,
    questions_file: Path = QUESTIONS,
) -> dict[str, Any]:
    """Measure retrieval quality against `env`'s running service (see the module docstring)."""
    questions = load_questions(questions_file)
    documents = load_documents(sorted({q.doc for q in questions}))
    spans = locate_all(questions, documents)
    mode_values, skipped = search_modes(modes)
    for mode, note in skipped.items():
        log(f"skipping the {mode} mode: {note}")
    pinned = [ChunkingStrategy.from_request(kind, chunk_size, chunk_overlap) for kind in strategies]
    clients = open_clients(env)
    try:
        bases = []
        for strategy in pinned:
            log(f"{strategy.kind.value}: uploading {len(documents)} documents")
            bases.append(await build_base(clients, strategy, documents, questions, spans))
        token = capability(env, [base.ref for base in bases])
        measured = {
            base.strategy.kind.value: await measure_base(clients, token, base, mode_values, questions)
            for base in bases
        }
    finally:
        await clients.close()
    return {
        "questions": len(questions),
        "styles": {
            style: sum(q.style == style for q in questions) for style in sorted({q.style for q in questions})
        },
        "documents": {name: len(text) for name, text in documents.items()},
        "top_k": TOP_K,
        "embedders": sorted({base.embedder for base in bases}),
        "skipped_modes": skipped,
        "strategies": measured,
    }


# --- the command ------------------------------------------------------------------------------------


def table(results: dict[str, Any]) -> str:
    """The headline numbers, one row per strategy and mode."""
    lines = [
        f"{results['questions']} questions, embedder {', '.join(results['embedders'])}, top_k {results['top_k']}",
        f"{'strategy':<10} {'chunks':>6} {'straddle':>8}  {'mode':<7} {'hit@1':>6} {'hit@5':>6} {'mrr@5':>6}"
        f"  {'para@5':>6} {'kw@5':>6} {'textrk':>6} {'p50 ms':>7}",
    ]
    for name, strategy in results["strategies"].items():
        for mode, m in strategy["modes"].items():
            if "error" in m:
                lines.append(f"{name:<10} {strategy['chunks']:>6} {'':>8}  {mode:<7} {m['error']}")
                continue
            styles = m["by_style"]
            para = styles.get("paraphrase", {}).get("hit@5")
            keyword = styles.get("keyword", {}).get("hit@5")
            lines.append(
                f"{name:<10} {strategy['chunks']:>6} {len(strategy['straddling']):>8}  {mode:<7}"
                f" {m['hit@1']:>6.3f} {m['hit@5']:>6.3f} {m['mrr@5']:>6.3f}"
                f"  {_cell(para)} {_cell(keyword)} {m['text_ranked']:>6.3f} {m['latency_ms_p50']:>7.1f}"
            )
    for mode, note in results["skipped_modes"].items():
        lines.append(f"(mode {mode} skipped: {note})")
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    return f"{value:>6.3f}" if value is not None else f"{'-':>6}"


def parse_overrides(pairs: Sequence[str]) -> dict[str, str]:
    overrides = {}
    for pair in pairs:
        name, equals, value = pair.partition("=")
        if not equals or not name:
            raise SystemExit(f"--set takes SETTING=VALUE, got {pair!r}")
        overrides[name] = value
    return overrides


async def run(args: argparse.Namespace) -> dict[str, Any]:
    began = time.perf_counter()
    overrides = parse_overrides(args.set)
    async with bench_env() as env:
        await env.start_service(**overrides)
        results = await run_knowledge_quality(
            env,
            modes=args.mode or MODES,
            strategies=args.strategy or STRATEGIES,
            chunk_size=args.chunk_size,
            chunk_overlap=args.overlap,
        )
    results["overrides"] = overrides
    results["seconds"] = round(time.perf_counter() - began, 1)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--strategy", action="append", choices=STRATEGIES, help="chunking strategy (repeatable; default: all)")  # fmt: skip
    parser.add_argument("--mode", action="append", choices=MODES, help="search mode (repeatable; default: all)")  # fmt: skip
    parser.add_argument(
        "--chunk-size", type=int, default=0, help="words per chunk (default 0: the server's 256)"
    )
    parser.add_argument("--overlap", type=int, default=0, help="chunk overlap in words (default 0)")
    parser.add_argument("--set", action="append", default=[], metavar="SETTING=VALUE", help="a tokensvc setting for this run (repeatable)")  # fmt: skip
    parser.add_argument("--output", type=Path, default=OUTPUT, help=f"results file (default {OUTPUT.relative_to(ROOT)})")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    args = parser.parse_args()
    results = asyncio.run(run(args))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1) if args.json else table(results))
    log(f"wrote {args.output}")
    sys.exit(0)


if __name__ == "__main__":
    main()
