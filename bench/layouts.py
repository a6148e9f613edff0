"""Which index layout keeps a bucket's search cost with the bucket, not the table (issue 15).

    .venv/bin/python -m bench.layouts [--scale full|1m] [--layouts shared,partial,hash64] [--queries N]

An experiment, not a regression benchmark: each layout gets the dataset (bench/dataset.py) in a
schema of its own (`layout_<name>.memories`, with the columns, defaults and generated column of
tokensvc.memories), bulk-loaded by binary COPY, its indexes built afterwards (timed and sized),
then ANALYZE. Then tokensvc's own vector-search statement (`search_statement`, with the
service's routing: exact up to `memory_exact_search_threshold` rows, four times that with a
filter; HNSW otherwise, re-run exactly when it returns fewer than k) runs per bucket class as the
superuser (no row-level security: the layout is what is compared), at concurrency 1 and 16, with
recall@10 and completeness against numpy's exact top-10. The layouts:

- `shared`: today's. One table and one HNSW index per dimension over every bucket; a large
  bucket's search is an iterative scan of that index, filtered to the bucket.
- `partial`: one table, and an HNSW index per bucket over the exact threshold (`WHERE bucket =
  '...'`), none shared. A search plans for its bucket (a custom plan), so the planner takes that
  bucket's index; smaller buckets are read exactly through the (bucket, id) key.
- `hashN`: the table hash-partitioned by bucket into N partitions, each with its own HNSW index
  (what `CREATE INDEX` on the partitioned table builds); a search prunes to one partition.

Results go to bench/results/layouts-<scale>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import re
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import numpy as np

from bench.client import domain_filter
from bench.dataset import CLASSES, DIM, Dataset, K, Query, make_dataset, make_queries
from bench.env import BenchEnv, bench_env
from bench.load import MEMORY_COLUMNS, binary_vectors, bucket_ids, copy_connection, memory_records
from bench.stats import percentile
from tokensvc.retrieval import SearchTuning, candidate_query
from tokensvc.settings import Settings
from tokensvc.storage.postgres import database as tokensvc_database
from tokensvc.storage.postgres.memories import search_statement
from tokensvc.storage.postgres.ranking import hnsw_settings

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SEED = 20_240_601
CONCURRENCY = (1, 16)
HNSW = f"USING hnsw ((embedding::vector({DIM})) vector_ip_ops) WITH (m = 16, ef_construction = 64)"
# Buckets queried per class (at most), in CLASSES order: as many as the full (100k) dataset has of
# the two large classes, so both scales search the same amount of data (--sample to change it).
SAMPLE = (60, 40, 12, 3)
_VECTOR_LITERAL = re.compile(r"'\[[^']*\]'")


def log(message: str) -> None:
    print(f"[layouts {time.strftime('%H:%M:%S')}] {message}", flush=True)


def _default(name: str) -> Any:
    return Settings.__dataclass_fields__[name].default


TUNING = SearchTuning(
    exact_threshold=_default("memory_exact_search_threshold"),
    ef_search=_default("memory_hnsw_ef_search"),
    max_scan_tuples=_default("memory_hnsw_max_scan_tuples"),
    candidates=_default("search_candidates"),
)


@dataclass(frozen=True)
class Layout:
    name: str
    partitions: int = 0  # hash partitions; 0: one table
    per_bucket: bool = False  # an HNSW index per bucket over the exact threshold

    @property
    def schema(self) -> str:
        return f"layout_{self.name}"

    def table_sql(self) -> list[str]:
        columns = "(LIKE tokensvc.memories INCLUDING DEFAULTS INCLUDING GENERATED)"
        if not self.partitions:
            return [f"CREATE TABLE {self.schema}.memories {columns}"]
        statements = [f"CREATE TABLE {self.schema}.memories {columns} PARTITION BY HASH (bucket)"]
        statements += [
            f"CREATE TABLE {self.schema}.memories_p{p} PARTITION OF {self.schema}.memories "
            f"FOR VALUES WITH (MODULUS {self.partitions}, REMAINDER {p})"
            for p in range(self.partitions)
        ]
        return statements

    def index_sql(self, data: Dataset, ids: Sequence[str]) -> list[str]:
        statements = [f"ALTER TABLE {self.schema}.memories ADD PRIMARY KEY (bucket, id)"]
        if not self.per_bucket:
            return [*statements, f"CREATE INDEX ON {self.schema}.memories {HNSW} WHERE dimension = {DIM}"]
        for b, size in enumerate(data.sizes):
            if size > TUNING.exact_threshold:
                statements.append(
                    f"CREATE INDEX ON {self.schema}.memories {HNSW} "
                    f"WHERE bucket = '{ids[b]}' AND dimension = {DIM}"
                )
        return statements


def layout_named(name: str) -> Layout:
    if name == "shared":
        return Layout(name)
    if name == "partial":
        return Layout(name, per_bucket=True)
    if name.startswith("hash") and name[4:].isdigit():
        return Layout(name, partitions=int(name[4:]))
    raise SystemExit(f"unknown layout {name!r}: shared, partial or hashN")


async def load(env: BenchEnv, layout: Layout, data: Dataset, ids: Sequence[str]) -> dict[str, Any]:
    conn = await copy_connection(env)
    try:
        await conn.execute(f"DROP SCHEMA IF EXISTS {layout.schema} CASCADE")
        await conn.execute(f"CREATE SCHEMA {layout.schema}")
        for statement in layout.table_sql():
            await conn.execute(statement)
        began = time.perf_counter()
        encoded = binary_vectors(data.vectors)
        buckets = list(range(len(data.sizes)))
        for start in range(0, len(buckets), 200):
            records = list(memory_records(data, buckets[start : start + 200], ids, encoded))
            await conn.copy_records_to_table(
                "memories", schema_name=layout.schema, records=records, columns=MEMORY_COLUMNS
            )
        copy_s = time.perf_counter() - began
        await conn.execute("SET maintenance_work_mem = '2GB'")
        await conn.execute("SET max_parallel_maintenance_workers = 1")
        began = time.perf_counter()
        statements = layout.index_sql(data, ids)
        for statement in statements:
            await conn.execute(statement)
        build_s = time.perf_counter() - began
        await conn.execute(f"ANALYZE {layout.schema}.memories")
        sizes = await conn.fetchrow(
            "SELECT coalesce(sum(pg_relation_size(i.indexrelid)) FILTER (WHERE a.amname = 'hnsw'), 0) AS hnsw, "
            "coalesce(sum(pg_relation_size(i.indexrelid)), 0) AS indexes, "
            "(SELECT sum(pg_relation_size(c.oid)) FROM pg_class c WHERE c.relnamespace = $1::regnamespace "
            "AND c.relkind = 'r') AS heap "
            "FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid JOIN pg_am a ON a.oid = ic.relam "
            "WHERE ic.relnamespace = $1::regnamespace",
            layout.schema,
        )
        assert sizes is not None
        return {
            "copy_s": round(copy_s, 1),
            "index_build_s": round(build_s, 1),
            "hnsw_indexes": sum("hnsw" in s for s in statements),
            "hnsw_mb": round(float(sizes["hnsw"]) / 2**20, 1),
            "indexes_mb": round(float(sizes["indexes"]) / 2**20, 1),
            "heap_mb": round(float(sizes["heap"]) / 2**20, 1),
        }
    finally:
        await conn.close()


@dataclass(frozen=True)
class Statement:
    sql: str
    params: list[Any]
    fallback: tuple[str, list[Any]] | None  # the exact re-run of a short approximate result


def statement_of(query: Query, bucket: str, size: int) -> Statement:
    filter_ = domain_filter(query.filter)
    exact = TUNING.exact(size, filtered=filter_ is not None, dimension=DIM)

    def one(exact: bool) -> tuple[str, list[Any]]:
        candidates = candidate_query(
            vector=query.vector, text=None, k=K, rows=size, exact=exact, tuning=TUNING
        )
        sql, params, _ = search_statement(bucket, candidates, filter_)
        return sql, params

    sql, params = one(exact)
    return Statement(sql, params, None if exact else one(True))


async def run_queries(
    pool: asyncpg.Pool, statements: Sequence[Statement], concurrency: int
) -> tuple[list[float], list[list[str]]]:
    latencies = [0.0] * len(statements)
    found: list[list[str]] = [[] for _ in statements]
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        statement = statements[i]
        async with gate, pool.acquire() as conn:
            began = time.perf_counter()
            rows = await conn.fetch(statement.sql, *statement.params)
            if statement.fallback is not None and len(rows) < K:
                rows = await conn.fetch(statement.fallback[0], *statement.fallback[1])
            latencies[i] = (time.perf_counter() - began) * 1000
        found[i] = [str(row["id"]) for row in rows]

    await asyncio.gather(*(one(i) for i in range(len(statements))))
    return latencies, found


def quality(queries: Sequence[Query], found: Sequence[list[str]]) -> dict[str, float]:
    recalls = [
        len(set(q.truth) & set(f)) / len(q.truth) for q, f in zip(queries, found, strict=True) if q.truth
    ]
    complete = [len(f) == min(K, q.matching) for q, f in zip(queries, found, strict=True)]
    return {
        "recall_at_10": round(statistics.mean(recalls), 4),
        "completeness": round(statistics.mean(complete), 4),
    }


async def search_layout(
    env: BenchEnv,
    layout: Layout,
    data: Dataset,
    ids: Sequence[str],
    queries_per_class: int,
    sample: Sequence[int],
) -> dict[str, Any]:
    settings = {
        "search_path": f"{layout.schema}, tokensvc, public",
        # Every search plans for its parameters (the service sets this for text and hybrid; a
        # per-bucket index needs it for vector searches too: a generic plan cannot know the bucket).
        "plan_cache_mode": "force_custom_plan",
        **hnsw_settings(ef_search=max(TUNING.ef_search, 2 * K), max_scan_tuples=TUNING.max_scan_tuples),
    }
    pool = await asyncpg.create_pool(
        **env.conninfo("superuser"),
        min_size=16,
        max_size=16,
        init=tokensvc_database._init_connection,  # the service's codecs (vector, jsonb)
        server_settings=settings,
    )
    assert pool is not None
    rng = np.random.default_rng(SEED)
    classes: dict[str, Any] = {}
    try:
        for c, bucket_class in enumerate(CLASSES):
            members = [
                b for b in range(len(data.sizes)) if bucket_class.low <= data.sizes[b] <= bucket_class.high
            ]
            chosen = sorted(rng.choice(members, size=min(sample[c], len(members)), replace=False).tolist())
            queries = make_queries(data, chosen, queries_per_class, seed=SEED + 100 + c)
            statements = [statement_of(q, ids[q.bucket], int(data.sizes[q.bucket])) for q in queries]
            await run_queries(pool, statements[:40], 4)  # warm the caches
            result: dict[str, Any] = {"buckets_queried": len(chosen), "queries": len(queries)}
            for concurrency in CONCURRENCY:
                latencies, found = await run_queries(pool, statements, concurrency)
                result[f"c{concurrency}"] = {
                    "p50_ms": round(percentile(latencies, 50), 2),
                    "p99_ms": round(percentile(latencies, 99), 2),
                }
                if concurrency == 1:
                    result.update(quality(queries, found))
            classes[bucket_class.name] = result
            log(f"{layout.name} {bucket_class.name}: {result}")
        plan = await explain_largest(pool, data, ids)
    finally:
        await pool.close()
    return {"classes": classes, "largest_bucket_plan": plan}


async def explain_largest(pool: asyncpg.Pool, data: Dataset, ids: Sequence[str]) -> list[str]:
    """The plan of an unfiltered search of the largest bucket: which index it reads."""
    b = int(np.argmax(data.sizes))
    query = make_queries(data, [b], 1, seed=SEED)[0]
    statement = statement_of(dataclasses.replace(query, filter="none"), ids[b], int(data.sizes[b]))
    async with pool.acquire() as conn:
        rows = await conn.fetch("EXPLAIN " + statement.sql, *statement.params)
    # The scan and its filter, without the query vector's 384 numbers.
    lines = [str(row[0]) for row in rows]
    return [
        _VECTOR_LITERAL.sub("'[...]'", line).strip() for line in lines if "Scan" in line or "Filter" in line
    ]


async def run(
    scale: str, names: Sequence[str], queries_per_class: int, sample: Sequence[int]
) -> dict[str, Any]:
    data = make_dataset(scale, seed=SEED)
    log(f"dataset {scale}: {data.rows} rows over {len(data.sizes)} buckets")
    results: dict[str, Any] = {
        "scale": scale,
        "rows": data.rows,
        "buckets": len(data.sizes),
        "sample": list(sample),
        "layouts": {},
    }
    async with bench_env() as env:
        ids = bucket_ids(env, len(data.sizes))
        for name in names:
            layout = layout_named(name)
            log(f"{name}: loading {data.rows} rows, then its indexes")
            built = await load(env, layout, data, ids)
            log(f"{name}: {built}")
            searched = await search_layout(env, layout, data, ids, queries_per_class, sample)
            results["layouts"][name] = {"build": built, **searched}
            await drop(env, layout)  # the disk and the page cache go to the next layout
    return results


async def drop(env: BenchEnv, layout: Layout) -> None:
    conn = await copy_connection(env)
    try:
        await conn.execute(f"DROP SCHEMA {layout.schema} CASCADE")
    finally:
        await conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--scale", default="full", help="a bench/dataset.py scale (default full: 100k rows)")
    parser.add_argument("--layouts", default="shared,partial,hash64", help="comma-separated layouts")
    parser.add_argument("--queries", type=int, default=400, help="queries per bucket class")
    parser.add_argument(
        "--sample",
        default=",".join(map(str, SAMPLE)),
        help="buckets queried per class, smallest class first (default %(default)s)",
    )
    parser.add_argument("--name", help="results file bench/results/layouts-NAME.json (default: the scale)")
    args = parser.parse_args()
    sample = [int(n) for n in args.sample.split(",")]
    results = asyncio.run(run(args.scale, args.layouts.split(","), args.queries, sample))
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"layouts-{args.name or args.scale}.json"
    out.write_text(json.dumps(results, indent=1) + "\n")
    log(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
