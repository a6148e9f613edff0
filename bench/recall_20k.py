"""Recall@10 of long-term memory search on a 20,000-memory bucket, against numpy's exact top-10.

A benchmark script, not a test: it starts a throwaway embedded PostgreSQL (+ pgvector) in a temporary
directory, applies the migrations, stores clustered 384-d unit vectors in one bucket through
`PostgresMemoryStore.insert` (batches of 256, the HNSW index maintained as the service maintains
it), runs ANALYZE as the schema owner (production has autovacuum statistics), and then runs the
same queries through `PostgresMemoryStore.search` (VECTOR) with `exact=False` at several `ef_search`
values and with `exact=True`, unfiltered and with two metadata filters (10% and 1% of the rows).

Modes: `hnsw` is `exact=False` exactly as the service runs it (PostgreSQL may still choose to scan
the bucket's rows and sort when a filter is selective: the `plan` column says what it chose);
`forced` is the same statement on connections with `enable_sort = off`, so the HNSW index with
pgvector 0.8's iterative scan is the plan, which is what a filtered search gets whenever the
planner does pick the index; `exact` is `exact=True`.

For each configuration it reports recall@10 (mean and worst query), completeness (the share of
queries that returned min(k, matching rows) results), latency, and the plan. Results go to stdout
as a table and to bench/results/recall_20k.json.

    .venv/bin/python -m bench.recall_20k [--rows 20000] [--queries 200] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import asyncpg
import numpy as np

from tokensvc.app import locate_database
from tokensvc.memory import Condition, Filter, Operator, matches
from tokensvc.memory.models import NewMemory
from tokensvc.retrieval import SearchTuning, candidate_query
from tokensvc.settings_sources import load_settings
from tokensvc.storage.postgres import Database, apply_schema_migrations, connect_once
from tokensvc.storage.postgres.database import _init_connection
from tokensvc.storage.postgres.memories import PostgresMemoryStore, search_statement
from tokensvc.storage.postgres.tenant import tenant_transaction
from tokensvc.storage.records import CandidateQuery, Tenant

DIM = 384
K = 10
CLUSTERS = 64
BATCH = 256
EF_SEARCH = (64, 128, 256)  # 64 is the service's default (SearchTuning.ef_search)
FILTERS: dict[str, Filter | None] = {
    "none": None,
    "10%": Condition("tag", Operator.EQ, "t3"),
    "1%": Condition("rare", Operator.EQ, True),
}
DEFAULT_OUTPUT = Path(__file__).parent / "results" / "recall_20k.json"


@dataclass(frozen=True)
class Row:
    filter: str
    matching: int
    mode: str
    ef_search: int | None
    plan: str
    recall_mean: float
    recall_min: float
    complete: float
    p50_ms: float
    p95_ms: float


def clustered(rng: np.random.Generator, centers: np.ndarray, count: int) -> np.ndarray:
    labels = rng.integers(0, len(centers), count)
    points = centers[labels] + rng.standard_normal((count, DIM)) * (0.9 / np.sqrt(DIM))
    return (points / np.linalg.norm(points, axis=1, keepdims=True)).astype(np.float32)


def metadata_of(i: int) -> dict[str, Any]:
    return {"n": i, "tag": f"t{i % 10}", "rare": i % 100 == 0}


async def load(store: PostgresMemoryStore, tenant: Tenant, vectors: np.ndarray) -> list[str]:
    bucket = tenant.buckets[0]
    ids = [str(uuid.uuid4()) for _ in range(len(vectors))]
    for start in range(0, len(vectors), BATCH):
        rows = []
        for i in range(start, min(len(vectors), start + BATCH)):
            content = f"memory {i}"
            rows.append(
                NewMemory(
                    id=ids[i],
                    content=content,
                    content_sha256=hashlib.sha256(content.encode()).digest(),
                    metadata=metadata_of(i),
                    idempotency_key=None,
                    ttl_seconds=None,
                    embedding=vectors[i],
                )
            )
        await store.insert(tenant, bucket, rows)
    return ids


async def index_only_pool(database: Database) -> asyncpg.Pool:
    """The serving role with `enable_sort = off`: the HNSW index is the only plan without a sort."""
    target = database.target
    credential = target.app_credentials.read()
    return await asyncpg.create_pool(
        host=target.host,
        port=target.port,
        database=target.database,
        user=credential.username,
        password=credential.password,
        min_size=1,
        max_size=2,
        init=_init_connection,
        server_settings={"search_path": "tokensvc, public", "enable_sort": "off"},
    )


def vector_query(query: np.ndarray, exact: bool, ef_search: int) -> CandidateQuery:
    """A plain VECTOR search of K (the store's fast statement)."""
    tuning = SearchTuning(ef_search=ef_search)
    return candidate_query(vector=query, text=None, k=K, rows=0, exact=exact, tuning=tuning)


async def plan_of(
    pool: asyncpg.Pool, tenant: Tenant, query: np.ndarray, f: Filter | None, exact: bool
) -> str:
    sql, params, settings = search_statement(tenant.buckets[0], vector_query(query, exact, 64), f)
    async with tenant_transaction(pool, tenant, settings=settings) as conn:
        lines = [row[0] for row in await conn.fetch(f"EXPLAIN {sql}", *params)]
    text = "\n".join(lines)
    if f"_hnsw_{DIM}" in text:  # memories_pNNN_hnsw_D: the bucket's partition's index
        return "hnsw"
    return "seq+sort" if "Seq Scan" in text else "bucket+sort"


@dataclass(frozen=True)
class Bench:
    tenant: Tenant
    probes: np.ndarray
    exact_scores: np.ndarray  # (queries, rows) float64
    metadata: list[dict[str, Any]]
    position: dict[str, int]  # memory id -> row index


async def measure(
    bench: Bench, runner: PostgresMemoryStore, runner_pool: asyncpg.Pool, name: str, mode: str, ef: int | None
) -> Row:
    f = FILTERS[name]
    keep = np.array([f is None or matches(f, m) for m in bench.metadata])
    matching = int(keep.sum())
    masked = np.where(keep[None, :], bench.exact_scores, -np.inf)
    exact = mode == "exact"
    recalls, complete, latencies = [], 0, []
    for q, probe in enumerate(bench.probes):
        truth = set(np.argsort(-masked[q], kind="stable")[: min(K, matching)].tolist())
        began = time.perf_counter()
        wanted = vector_query(probe, exact, ef or 64)
        outcome = await runner.search(
            bench.tenant, bench.tenant.buckets[0], lambda _rows, wanted=wanted: wanted,
            row_count=0, count_cap=1, filter_=f, embedder="bench",
        )  # fmt: skip
        hits = [c.item for c in outcome.candidates]
        latencies.append((time.perf_counter() - began) * 1000)
        got = {bench.position[hit.id] for hit in hits}
        recalls.append(len(got & truth) / len(truth))
        complete += len(hits) == min(K, matching)
    latencies.sort()
    return Row(
        filter=name,
        matching=matching,
        mode=mode,
        ef_search=ef,
        plan=await plan_of(runner_pool, bench.tenant, bench.probes[0], f, exact),
        recall_mean=round(statistics.fmean(recalls), 4),
        recall_min=round(min(recalls), 4),
        complete=round(complete / len(bench.probes), 4),
        p50_ms=round(latencies[len(latencies) // 2], 2),
        p95_ms=round(latencies[max(0, int(len(latencies) * 0.95) - 1)], 2),
    )


async def as_owner(database: Database, sql: str, *, app_role: str | None = None) -> None:
    owner = database.target.owner_credentials
    assert owner is not None
    conn = await connect_once(database.target, owner.read())
    try:
        if app_role is not None:
            await apply_schema_migrations(conn, app_role=app_role)
        if sql:
            await conn.execute(sql)
    finally:
        await conn.close()


async def run(rows: int, queries: int, seed: int) -> dict[str, Any]:
    state = Path(tempfile.mkdtemp(prefix="tokensvc-bench-"))
    settings = load_settings(environ={}, overrides={"state_dir": str(state), "pool_max_size": 4})
    database = await locate_database(settings)
    try:
        await as_owner(database, "", app_role=settings.database_app_role)
        pool = await database.open_pool()
        store = PostgresMemoryStore(pool)
        forced_pool = await index_only_pool(database)
        stores = {"hnsw": (store, pool), "forced": (PostgresMemoryStore(forced_pool), forced_pool)}

        rng = np.random.default_rng(seed)
        centers = rng.standard_normal((CLUSTERS, DIM))
        centers /= np.linalg.norm(centers, axis=1, keepdims=True)
        vectors = clustered(rng, centers, rows)
        probes = clustered(rng, centers, queries)
        bucket = "v1." + base64.b32encode(os.urandom(20)).decode().lower().rstrip("=")
        tenant = Tenant("bench", "recall", (bucket,))

        started = time.perf_counter()
        ids = await load(store, tenant, vectors)
        print(f"stored {rows} memories in {time.perf_counter() - started:.1f} s")
        await as_owner(database, "ANALYZE tokensvc.memories")
        bench = Bench(
            tenant=tenant,
            probes=probes,
            exact_scores=probes.astype(np.float64) @ vectors.astype(np.float64).T,
            metadata=[metadata_of(i) for i in range(rows)],
            position={memory_id: i for i, memory_id in enumerate(ids)},
        )

        results: list[Row] = []
        print(HEADER)
        for name in FILTERS:
            configs: list[tuple[str, int | None]] = [
                *(("hnsw", ef) for ef in EF_SEARCH),
                *(("forced", ef) for ef in EF_SEARCH),
                ("exact", None),
            ]
            for mode, ef in configs:
                runner, runner_pool = stores.get(mode, (store, pool))
                results.append(await measure(bench, runner, runner_pool, name, mode, ef))
                print_row(results[-1])
        async with pool.acquire() as conn:
            versions = await conn.fetchrow(
                "SELECT current_setting('server_version') AS postgres, "
                "(SELECT extversion FROM pg_extension WHERE extname = 'vector') AS pgvector"
            )
        await forced_pool.close()
        return {
            "rows": rows,
            "queries": queries,
            "k": K,
            "dimension": DIM,
            "clusters": CLUSTERS,
            "seed": seed,
            "max_scan_tuples": SearchTuning().max_scan_tuples,
            "postgres": versions["postgres"],
            "pgvector": versions["pgvector"],
            "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
            "results": [asdict(row) for row in results],
        }
    finally:
        await database.close()
        shutil.rmtree(state, ignore_errors=True)


HEADER = f"{'filter':>6} {'matching':>8} {'mode':>6} {'ef':>4} {'plan':>11} {'recall':>7} {'min':>6} "
HEADER += f"{'complete':>8} {'p50 ms':>7} {'p95 ms':>7}"


def print_row(row: Row) -> None:
    ef = "-" if row.ef_search is None else str(row.ef_search)
    print(
        f"{row.filter:>6} {row.matching:>8} {row.mode:>6} {ef:>4} {row.plan:>11} {row.recall_mean:>7.4f} "
        f"{row.recall_min:>6.2f} {row.complete:>8.1%} {row.p50_ms:>7.2f} {row.p95_ms:>7.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=20_000, help="memories in the bucket (default 20000)")
    parser.add_argument("--queries", type=int, default=200, help="queries per configuration (default 200)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the data and queries (default 1)")
    parser.add_argument(
        "--json", type=Path, default=DEFAULT_OUTPUT, help=f"report path (default {DEFAULT_OUTPUT})"
    )
    args = parser.parse_args()
    report = asyncio.run(run(args.rows, args.queries, args.seed))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
