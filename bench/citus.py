"""Citus next to one PostgreSQL node: the same data, the same calls, latencies side by side.

    python -m bench.citus --citus-dsn postgresql://SUPERUSER:PASSWORD@HOST:PORT/DATABASE

The DSN names a database on a Citus coordinator with the `citus` and `vector` extensions and its
workers added (the contract of the Citus test suite, TOKENSVC_TEST_CITUS_DSN); the bench prepares
tokensvc's roles there and migrates, which distributes the schema. The single node is the embedded
PostgreSQL 18 the tests use, on this machine.

Both get a tokensvc in this process, configured alike, with the `hash` embedder (the embedder's
cost is the same on both engines and would only hide the database's), and the same memories:
`--users` users of `--rows` each, written through Remember. Then, in interleaved rounds, each
engine answers the same calls one at a time over mTLS gRPC: a vector search, a hybrid search, a
one-memory Remember, a ListMemories page. The report is each call's p50/p99 and the ratio of
Citus to the single node, measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from bench.env import bench_env, settings_for
from bench.stats import latency_summary
from tests.citus.cluster import prepare_citus_database
from tokensvc.app import Service, locate_database, migrate
from tokensvc.auth.devpki import DevPaths
from tokensvc.storage.postgres import EmbeddedPaths, EmbeddedPostgresError
from tokensvc.v1 import common_pb2, memory_pb2, memory_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "citus.json"
WORDS = [
    "deploy",
    "window",
    "tuesday",
    "budget",
    "review",
    "release",
    "freeze",
    "incident",
    "retro",
    "roadmap",
    "coffee",
]
TIMEOUT = 30.0


@dataclass
class Engine:
    name: str
    service: Service
    stub: memory_pb2_grpc.MemoryServiceStub
    channel: grpc.aio.Channel


def sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(8)) + f" {rng.randrange(10**9)}"


def channel_to(service: Service, dev: DevPaths) -> grpc.aio.Channel:
    cert, key = dev.client("launcher")
    credentials = grpc.ssl_channel_credentials(
        root_certificates=dev.ca_cert.read_bytes(),
        private_key=key.read_bytes(),
        certificate_chain=cert.read_bytes(),
    )
    return grpc.aio.secure_channel(f"127.0.0.1:{service.port}", credentials)


async def timed(call: Callable[[], Awaitable[Any]]) -> float:
    began = time.perf_counter()
    await call()
    return (time.perf_counter() - began) * 1000


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(7)
    citus_root = Path(tempfile.mkdtemp(prefix="tokensvc-bench-citus-"))
    engines: list[Engine] = []
    try:
        async with bench_env() as env:
            citus_paths = EmbeddedPaths(citus_root)
            try:
                citus_dsn = await prepare_citus_database(args.citus_dsn, citus_paths)
            except EmbeddedPostgresError as exc:
                raise SystemExit(f"--citus-dsn: {exc}") from None
            citus_settings = settings_for(
                citus_dsn, citus_paths, citus_root, env.dev, memory_embedder="hash", log_level="WARNING"
            )
            began = time.perf_counter()
            await migrate(await locate_database(citus_settings), citus_settings)
            migrate_s = time.perf_counter() - began
            single = await env.start_service(memory_embedder="hash")
            engines.append(Engine("postgresql", single, *_stub(single, env.dev)))
            distributed = Service(citus_settings)
            await distributed.start()
            engines.append(Engine("citus", distributed, *_stub(distributed, env.dev)))

            run_id = f"{time.time_ns():x}"
            users = [f"bench-{run_id}-{u}" for u in range(args.users)]
            tokens = {
                u: env.capability(user=u, per_user=True, long_term_memory=True, ttl_seconds=3600)
                for u in users
            }
            for engine in engines:
                for user in users:
                    items = [memory_pb2.RememberItem(content=sentence(rng)) for _ in range(args.rows)]
                    for start in range(0, len(items), 100):
                        await engine.stub.Remember(
                            memory_pb2.RememberRequest(items=items[start : start + 100]),
                            metadata=(("authorization", f"Bearer {tokens[user]}"),),
                            timeout=TIMEOUT,
                        )
            calls: dict[str, dict[str, list[float]]] = {e.name: {} for e in engines}
            plan = [(rng.choice(users), sentence(rng)) for _ in range(args.calls)]
            for round_ in range(args.rounds):
                for engine in engines if round_ % 2 == 0 else reversed(engines):
                    for user, query in plan:
                        await _measure(engine, tokens[user], query, calls[engine.name])
    finally:
        for engine in engines:
            await engine.channel.close()
            await engine.service.stop(grace=0)
        shutil.rmtree(citus_root, ignore_errors=True)
    report: dict[str, Any] = {
        "users": args.users,
        "rows_per_user": args.rows,
        "calls": args.calls,
        "rounds": args.rounds,
        "citus_migrate_seconds": round(migrate_s, 1),
        "calls_ms": {},
    }
    for call in calls["postgresql"]:
        single_summary = latency_summary(calls["postgresql"][call])
        citus_summary = latency_summary(calls["citus"][call])
        report["calls_ms"][call] = {
            "postgresql": single_summary,
            "citus": citus_summary,
            "citus_over_postgresql_p50": round(citus_summary["p50_ms"] / single_summary["p50_ms"], 2),
            "citus_over_postgresql_p99": round(citus_summary["p99_ms"] / single_summary["p99_ms"], 2),
        }
    return report


def _stub(service: Service, dev: DevPaths) -> tuple[memory_pb2_grpc.MemoryServiceStub, grpc.aio.Channel]:
    channel = channel_to(service, dev)
    return memory_pb2_grpc.MemoryServiceStub(channel), channel


async def _measure(engine: Engine, token: str, query: str, into: dict[str, list[float]]) -> None:
    metadata = (("authorization", f"Bearer {token}"),)
    stub = engine.stub
    vector, hybrid = common_pb2.SEARCH_MODE_VECTOR, common_pb2.SEARCH_MODE_HYBRID
    calls: dict[str, Callable[[], Awaitable[Any]]] = {
        "search_vector": lambda: stub.SearchMemories(
            memory_pb2.SearchMemoriesRequest(query_text=query, top_k=10, mode=vector),
            metadata=metadata,
            timeout=TIMEOUT,
        ),
        "search_hybrid": lambda: stub.SearchMemories(
            memory_pb2.SearchMemoriesRequest(query_text=query, top_k=10, mode=hybrid),
            metadata=metadata,
            timeout=TIMEOUT,
        ),
        "remember_one": lambda: stub.Remember(
            memory_pb2.RememberRequest(items=[memory_pb2.RememberItem(content=query)]),
            metadata=metadata,
            timeout=TIMEOUT,
        ),
        "list_page": lambda: stub.ListMemories(
            memory_pb2.ListMemoriesRequest(page_size=20), metadata=metadata, timeout=TIMEOUT
        ),
    }
    for name, call in calls.items():
        into.setdefault(name, []).append(await timed(call))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--citus-dsn", required=True, help="superuser DSN of a database on a Citus coordinator"
    )
    parser.add_argument("--users", type=int, default=20, help="users, each a bucket (default %(default)s)")
    parser.add_argument("--rows", type=int, default=200, help="memories per user (default %(default)s)")
    parser.add_argument(
        "--calls", type=int, default=300, help="calls of each kind per round (default %(default)s)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default %(default)s)")
    parser.add_argument("--output", type=Path, default=RESULTS, help="results file (default %(default)s)")
    args = parser.parse_args()
    report = asyncio.run(run(args))
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["calls_ms"], indent=2))


if __name__ == "__main__":
    main()
