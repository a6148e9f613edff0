"""`make bench`: tokensvc measured against the physical floor and against a peer, in one run.

    .venv/bin/python -m bench.run [--scale quick|full|1m] [--name NAME] [--set SETTING=VALUE]... [--no-docs]

One run starts a throwaway embedded PostgreSQL (migrated) and an in-process tokensvc over mTLS
(dev PKI in a temporary state directory), and a separate load-generator process that plays the
caller (bench/client.py). In order:

1. writes: Remember through the service (batches of 256, hash embedder) against a binary COPY of
   the same rows into scratch tables of the same shape (all indexes) and bare (no index);
2. knowledge upload throughput (UploadDocument, markdown chunking, hash embedder);
3. capability verification, cold (a fresh token per call) and cached (the same token), per RPC
   (VerifyCapability) and in-process (Authenticator.authenticate);
4. the search dataset (bench/dataset.py: 100k clustered 384-d memories over 1,000 skewed
   buckets) bulk-loaded by COPY, the HNSW index built after, ANALYZE; tokensvc restarted;
5. the peer (LangGraph AsyncPostgresStore, bench/peer.py): a sample of puts through its API (its
   write throughput), the rest of the same rows COPYed into its tables, its index built after;
6. searches per bucket-size class, at concurrency 1 and 16, through the service, the raw SQL
   (tenant transaction and bare) and the peer, interleaved in two rounds; recall@10 against numpy's
   exact top-10 and completeness (min(k, matching) results) from the concurrency-1 runs. With
   `--workers N` the service of this step is `tokensvc serve --workers N` in child processes.

Results go to bench/results/<name>.json and the summary to docs/benchmarks.md (between the
generated-results markers) with the plot docs/benchmarks-latency.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import numpy as np
from cryptography import x509
from cryptography.hazmat.primitives import hashes

from bench import report
from bench.client import worker_main
from bench.dataset import (
    CLASSES,
    DIM,
    Dataset,
    K,
    Query,
    content_of,
    make_dataset,
    make_queries,
    metadata_of,
    sha256_of,
)
from bench.env import AGENT, NAMESPACE, BenchEnv, bench_env, connect_as
from bench.load import MEMORY_COLUMNS, binary_vectors, bucket_ids, copy_connection, load_memories, user_of
from bench.stats import latency_summary, percentile
from bench.workers import WorkerHandle
from tokensvc.auth.buckets import bucket_id
from tokensvc.auth.devpki import LAUNCHER_SPIFFE_ID
from tokensvc.auth.identity import Caller, Role
from tokensvc.embedders import HashEmbedder
from tokensvc.retrieval import SearchTuning

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DOCS = ROOT / "docs" / "benchmarks.md"
PLOT = ROOT / "docs" / "benchmarks-latency.png"
PATHS = ("service", "raw_tenant", "raw_bare", "peer")
CONCURRENCY = (1, 16)
SEED = 20_240_601


@dataclass(frozen=True)
class Plan:
    scale: str
    queries_per_class: int
    bucket_sample: tuple[int, int, int, int]  # buckets queried per class (at most), CLASSES order
    remember_rows: int
    peer_put_rows: int
    verify_tokens: int
    documents: int
    document_words: int


PLANS = {
    "full": Plan("full", 800, (120, 60, 12, 3), 5120, 2048, 300, 4, 60_000),
    # Ten times the rows and buckets of every class; as many large buckets queried as at 100k, so
    # both scales search the same amount of data and only the table around it grew (issue 15).
    "1m": Plan("1m", 800, (120, 60, 12, 3), 5120, 2048, 300, 4, 60_000),
    "quick": Plan("quick", 240, (40, 18, 3, 1), 2048, 1024, 120, 2, 30_000),
}


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


class Tokens:
    """Capabilities minted with the dev signing key, one per user (cached)."""

    def __init__(self, env: BenchEnv):
        self._env = env
        self._by_user: dict[str, str] = {}

    def fresh(self, user: str) -> str:
        return self._env.capability(
            user=user,
            per_user=True,
            long_term_memory=True,
            ttl_seconds=3600,
        )

    def of(self, user: str) -> str:
        if user not in self._by_user:
            self._by_user[user] = self.fresh(user)
        return self._by_user[user]


def search_tuning(env: BenchEnv) -> SearchTuning:
    """The running service's search tuning (its routing is what the raw SQL paths replay)."""
    if env.service is None:  # a server process (--workers): its settings, as app.py builds it
        settings = env.settings
        return SearchTuning(
            exact_threshold=settings.memory_exact_search_threshold,
            ef_search=settings.memory_hnsw_ef_search,
            max_scan_tuples=settings.memory_hnsw_max_scan_tuples,
            candidates=settings.search_candidates,
        )
    assert env.service.memory is not None
    return env.service.memory.engine.tuning


def service_port(env: BenchEnv) -> int:
    if env.service is not None:
        return env.service.port
    assert env.process is not None
    return env.process.port


async def setup_worker(worker: WorkerHandle, env: BenchEnv, connections: int = 1) -> None:
    settings = env.settings
    pki = {}
    for role in ("launcher", "control-plane"):
        cert, key = env.dev.client(role)
        pki[role] = {"ca": env.dev.ca_cert.read_bytes(), "cert": cert.read_bytes(), "key": key.read_bytes()}
    await worker.call(
        "setup",
        port=service_port(env),
        pki=pki,
        conninfo={"app": env.conninfo("app"), "superuser": env.conninfo("superuser")},
        pool_size=settings.pool_max_size,
        tuning=asdict(search_tuning(env)),
        namespace=NAMESPACE,
        agent=AGENT,
        connections=connections,
    )


# --- 1. writes ------------------------------------------------------------------------------------


async def measure_writes(env: BenchEnv, worker: WorkerHandle, tokens: Tokens, plan: Plan) -> dict[str, Any]:
    rows = plan.remember_rows
    texts = [
        f"remembered fact {i}: the build of service {i % 37} moved to runner pool {i % 11}"
        for i in range(rows)
    ]
    metadata = [{"n": i, "tag": f"t{i % 10}"} for i in range(rows)]
    su = await connect_as(env, "superuser")
    try:
        await su.execute("CREATE SCHEMA bench_scratch")
        await su.execute("CREATE TABLE bench_scratch.memories_same (LIKE tokensvc.memories INCLUDING ALL)")
        await su.execute(
            "CREATE TABLE bench_scratch.memories_bare (LIKE tokensvc.memories INCLUDING DEFAULTS INCLUDING GENERATED)"
        )
    finally:
        await su.close()

    log(f"remember: {rows} memories through the service, batches of 256")
    remembered = await worker.call(
        "remember", token=tokens.of("writer"), texts=texts, metadata=metadata, batch=256
    )

    writer_bucket = bucket_id(env.keyring, NAMESPACE, AGENT, "writer")
    vectors = HashEmbedder().vectorize(texts).astype("<f4")
    copy_rows = [
        (writer_bucket, uuid.uuid4(), NAMESPACE, AGENT, text, sha256_of(text), json.dumps(meta), None, DIM)
        for text, meta in zip(texts, metadata, strict=True)
    ]
    copies = {}
    for table in ("bench_scratch.memories_same", "bench_scratch.memories_bare"):
        log(f"COPY: the same {rows} rows into {table}")
        copies[table] = await worker.call(
            "copy", table=table, rows=copy_rows, vectors=vectors.tobytes(), columns=list(MEMORY_COLUMNS)
        )
    su = await connect_as(env, "superuser")
    try:
        await su.execute("DELETE FROM tokensvc.memories WHERE bucket = $1", writer_bucket)
        await su.execute("DROP SCHEMA bench_scratch CASCADE")
    finally:
        await su.close()

    def rate(result: dict[str, Any]) -> float:
        return round(result["rows"] / result["seconds"], 1)

    same, bare = copies["bench_scratch.memories_same"], copies["bench_scratch.memories_bare"]
    return {
        "rows": rows,
        "batch": 256,
        "remember_rows_per_s": rate(remembered),
        "remember_batch_p50_ms": round(percentile(remembered["batch_ms"], 50), 2),
        "copy_same_shape_rows_per_s": rate(same),
        "copy_bare_rows_per_s": rate(bare),
        "ratio_vs_copy_same_shape": round(rate(remembered) / rate(same), 3),
        "ratio_vs_copy_bare": round(rate(remembered) / rate(bare), 3),
    }


# --- 2. knowledge upload ---------------------------------------------------------------------------


def markdown_document(rng: np.random.Generator, words: int) -> str:
    vocabulary = [f"{a}{b}" for a in ("deploy", "runner", "cache", "index", "vector", "tenant", "pool", "shard")
                  for b in ("", "s", "ing", "ed", "er", "able")]  # fmt: skip
    parts, written, section = [], 0, 0
    while written < words:
        section += 1
        parts.append(f"\n## Section {section}\n")
        for _ in range(int(rng.integers(2, 6))):
            n = int(rng.integers(40, 160))
            sentence_words = rng.choice(vocabulary, n)
            parts.append(" ".join(sentence_words) + ".\n")
            written += n
    return f"# Runbook {rng.integers(1_000_000)}\n" + "\n".join(parts)


async def measure_upload(worker: WorkerHandle, plan: Plan) -> dict[str, Any]:
    rng = np.random.default_rng(SEED + 7)
    documents = [markdown_document(rng, plan.document_words) for _ in range(plan.documents)]
    log(f"knowledge upload: {plan.documents} markdown documents of ~{plan.document_words} words")
    result = await worker.call(
        "upload", namespace=NAMESPACE, ref="bench-kb", documents=documents, chunk_size=256
    )
    return {
        "documents": plan.documents,
        "bytes": result["bytes"],
        "chunks": result["chunks"],
        "chunk_size_words": 256,
        "chunks_per_s": round(result["chunks"] / result["seconds"], 1),
        "mb_per_s": round(result["bytes"] / result["seconds"] / 1e6, 3),
    }


# --- 3. capability verification ----------------------------------------------------------------------


async def measure_verification(
    env: BenchEnv, worker: WorkerHandle, tokens: Tokens, plan: Plan
) -> dict[str, Any]:
    n = plan.verify_tokens
    log(f"capability verification: {n} fresh tokens vs one cached token")
    fresh = [tokens.fresh(f"verify-{i}") for i in range(n)]
    cached = tokens.of("verify-cached")
    health = (await worker.call("health", calls=n))["latencies_ms"]
    rpc_cold = (await worker.call("verify", tokens=fresh))["latencies_ms"]
    rpc_cached = (await worker.call("verify", tokens=[cached] * (n + 1)))["latencies_ms"][1:]

    assert env.service is not None
    assert env.service.authenticator is not None
    authenticator = env.service.authenticator
    cert, _ = env.dev.client("launcher")
    leaf = x509.load_pem_x509_certificate(cert.read_bytes())
    caller = Caller(
        LAUNCHER_SPIFFE_ID, leaf.fingerprint(hashes.SHA256()), frozenset({Role.LAUNCHER}), (NAMESPACE, AGENT)
    )
    in_cold, in_cached = [], []
    for i in range(n):
        token = tokens.fresh(f"inproc-{i}")
        began = time.perf_counter()
        await authenticator.authenticate(token, caller)
        in_cold.append((time.perf_counter() - began) * 1e6)
        began = time.perf_counter()
        await authenticator.authenticate(token, caller)
        in_cached.append((time.perf_counter() - began) * 1e6)
    return {
        "tokens": n,
        "rpc_health": latency_summary(health),
        "rpc_cold": latency_summary(rpc_cold),
        "rpc_cached": latency_summary(rpc_cached),
        "rpc_cold_minus_cached_p50_ms": round(percentile(rpc_cold, 50) - percentile(rpc_cached, 50), 3),
        "in_process_cold_p50_us": round(percentile(in_cold, 50), 1),
        "in_process_cached_p50_us": round(percentile(in_cached, 50), 1),
    }


# --- 4./5. the search dataset, for tokensvc and the peer --------------------------------------------


async def load_peer(env: BenchEnv, worker: WorkerHandle, data: Dataset, plan: Plan) -> dict[str, Any]:
    su = await asyncpg.connect(**env.conninfo("superuser", "postgres"))
    try:
        await su.execute("CREATE DATABASE langgraph_bench")
    finally:
        await su.close()
    su = await asyncpg.connect(**env.conninfo("superuser", "langgraph_bench"))
    try:
        await su.execute("CREATE EXTENSION IF NOT EXISTS vector")
    finally:
        await su.close()
    info = env.conninfo("superuser", "langgraph_bench")
    conninfo = (
        f"host={info['host']} port={info['port']} user={info['user']} "
        f"password={info['password']} dbname={info['database']}"
    )
    await worker.call("open_peer", conninfo=conninfo, pool_size=env.settings.pool_max_size)
    pairs = [(b, i) for b in range(len(data.sizes)) for i in data.bucket_rows(b)]
    sample = pairs[: plan.peer_put_rows]
    log(f"peer: {len(sample)} puts through AsyncPostgresStore.abatch (batches of 256)")
    puts = await worker.call("peer_puts", scale=plan.scale, seed=SEED, pairs=sample, batch=256)

    rest = pairs[plan.peer_put_rows :]
    log(f"peer: the other {len(rest)} rows by COPY into its tables, then its HNSW index")
    encoded = binary_vectors(data.vectors)
    store_rows, vector_rows = [], []
    for b, i in rest:
        j = i - int(data.offsets[b])
        prefix = f"memories.{user_of(b)}"
        text = content_of(b, j)
        store_rows.append((prefix, data.ids[i], json.dumps({"text": text, **metadata_of(j)})))
        vector_rows.append((prefix, data.ids[i], "text", encoded[i]))
    began = time.perf_counter()
    conn = await copy_connection(env, "superuser", "langgraph_bench")
    try:
        await conn.execute("DROP INDEX store_vectors_embedding_idx")
        await conn.copy_records_to_table("store", records=store_rows, columns=["prefix", "key", "value"])
        await conn.copy_records_to_table(
            "store_vectors", records=vector_rows, columns=["prefix", "key", "field_name", "embedding"]
        )
        await conn.execute("SET maintenance_work_mem = '1GB'")
        await conn.execute("SET max_parallel_maintenance_workers = 1")
        # The peer's own migration statement (langgraph/store/postgres/base.py), without CONCURRENTLY.
        await conn.execute(
            "CREATE INDEX IF NOT EXISTS store_vectors_embedding_idx ON store_vectors "
            "USING hnsw (embedding vector_cosine_ops)"
        )
        await conn.execute("ANALYZE store")
        await conn.execute("ANALYZE store_vectors")
    finally:
        await conn.close()
    return {
        "put_rows": len(sample),
        "put_rows_per_s": round(puts["rows"] / puts["seconds"], 1),
        "copied_rows": len(rest),
        "load_s": round(time.perf_counter() - began, 1),
    }


# --- 6. searches --------------------------------------------------------------------------------------


def sample_buckets(data: Dataset, plan: Plan) -> dict[str, list[int]]:
    rng = np.random.default_rng(SEED + 1)
    chosen = {}
    for bucket_class, cap in zip(CLASSES, plan.bucket_sample, strict=True):
        members = data.buckets_of_class(bucket_class.name)
        if len(members) > cap:
            members = sorted(int(b) for b in rng.choice(members, cap, replace=False))
        chosen[bucket_class.name] = members
    return chosen


def query_items(
    data: Dataset, queries: list[Query], ids: list[str], tokens: Tokens, offset: int
) -> list[dict[str, Any]]:
    return [
        {
            "n": offset + n,
            "bucket_id": ids[q.bucket],
            "user": user_of(q.bucket),
            "size": int(data.sizes[q.bucket]),
            "filter": q.filter,
            "vector": q.vector.astype("<f4").tobytes(),
            "token": tokens.of(user_of(q.bucket)),
        }
        for n, q in enumerate(queries)
    ]


def quality(queries: list[Query], found: list[list[str]]) -> dict[str, Any]:
    recalls, complete, by_filter = [], 0, {}
    for q, ids in zip(queries, found, strict=True):
        truth = set(q.truth)
        recall = 1.0 if not truth else len(truth & set(ids)) / len(truth)
        recalls.append(recall)
        ok = len(ids) == min(K, q.matching)
        complete += ok
        entry = by_filter.setdefault(q.filter, {"recall": [], "complete": 0, "n": 0})
        entry["recall"].append(recall)
        entry["complete"] += ok
        entry["n"] += 1
    return {
        "recall_at_10": round(statistics.fmean(recalls), 4),
        "recall_min": round(min(recalls), 2),
        "completeness": round(complete / len(queries), 4),
        "by_filter": {
            name: {
                "recall_at_10": round(statistics.fmean(e["recall"]), 4),
                "completeness": round(e["complete"] / e["n"], 4),
                "n": e["n"],
            }
            for name, e in by_filter.items()
        },
    }


async def measure_searches(
    worker: WorkerHandle,
    data: Dataset,
    ids: list[str],
    tokens: Tokens,
    plan: Plan,
    threshold: int,
    paths: tuple[str, ...],
) -> dict[str, Any]:
    chosen = sample_buckets(data, plan)
    classes: dict[str, Any] = {}
    per_query: dict[str, list[tuple[int, float]]] = {path: [] for path in paths}  # (bucket size, c=1 latency)
    for c, bucket_class in enumerate(CLASSES):
        buckets = chosen[bucket_class.name]
        queries = make_queries(data, buckets, plan.queries_per_class, seed=SEED + 100 + c)
        items = query_items(data, queries, ids, tokens, offset=c * 100_000)
        log(
            f"search {bucket_class.name}: {len(buckets)} buckets, {len(queries)} queries x {len(paths)} paths x c={CONCURRENCY}"
        )
        warm = items[: min(60, len(items))]
        for path in paths:
            await worker.call("search", path=path, items=warm, concurrency=4)
        latencies: dict[str, dict[int, list[float]]] = {p: {c: [] for c in CONCURRENCY} for p in paths}
        found: dict[str, list[list[str]]] = {p: [[] for _ in items] for p in paths}
        for concurrency in CONCURRENCY:
            for half in (0, 1):
                order = paths if half == 0 else paths[::-1]  # interleaved so drift hits every path alike
                for path in order:
                    chunk = list(range(half, len(items), 2))
                    result = await worker.call(
                        "search", path=path, items=[items[i] for i in chunk], concurrency=concurrency
                    )
                    latencies[path][concurrency] += result["latencies_ms"]
                    if concurrency == 1:
                        for i, got, ms in zip(chunk, result["ids"], result["latencies_ms"], strict=True):
                            found[path][i] = got
                            per_query[path].append((int(data.sizes[queries[i].bucket]), ms))
        sizes = data.sizes[buckets]
        classes[bucket_class.name] = {
            "buckets_queried": len(buckets),
            "bucket_rows_min": int(sizes.min()),
            "bucket_rows_max": int(sizes.max()),
            "queries": len(queries),
            "hnsw_share": round(float(np.mean([data.sizes[q.bucket] > threshold for q in queries])), 3),
            "latency": {p: {f"c{c}": latency_summary(latencies[p][c]) for c in CONCURRENCY} for p in paths},
            "quality": {p: quality(queries, found[p]) for p in paths},
        }
    return {"classes": classes, "by_size": report.size_bins(per_query)}


# --- the run --------------------------------------------------------------------------------------------


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        overrides[name] = value
    return overrides


async def run(args: argparse.Namespace) -> dict[str, Any]:
    began = time.perf_counter()
    plan = PLANS[args.scale]
    # The storage path is measured with the instant `hash` embedder (and query vectors), so no
    # model time hides the service's own cost; bench/quality.py measures the real model.
    overrides = {"memory_embedder": "hash", **parse_overrides(args.set)}
    timings: dict[str, float] = {}

    def lap(name: str, since: float) -> float:
        now = time.perf_counter()
        timings[name] = round(now - since, 1)
        return now

    data = make_dataset(plan.scale, seed=SEED)
    mark = lap("dataset_s", began)
    log(f"dataset: {data.rows} memories over {len(data.sizes)} buckets ({plan.scale})")
    worker = WorkerHandle(worker_main)
    results: dict[str, Any] = {}
    try:
        async with bench_env() as env, worker_connections(worker):
            await env.start_service(**overrides)
            assert env.service is not None
            await setup_worker(worker, env)
            tokens = Tokens(env)
            mark = lap("start_s", mark)
            if not args.search_only:
                results["writes"] = await measure_writes(env, worker, tokens, plan)
                mark = lap("writes_s", mark)
                results["upload"] = await measure_upload(worker, plan)
                mark = lap("upload_s", mark)
                results["verification"] = await measure_verification(env, worker, tokens, plan)
                mark = lap("verification_s", mark)
            ids = await load_dataset(env, data, results)
            mark = lap("load_s", mark)
            paths = PATHS if not args.no_peer else PATHS[:3]
            if not args.no_peer:
                results["peer_load"] = await load_peer(env, worker, data, plan)
                mark = lap("peer_load_s", mark)
            # A fresh tokensvc, as a deployment would be after a bulk load: no cache carries over.
            await restart_for_search(env, args.workers, overrides)
            await setup_worker(worker, env, args.connections)
            settings = env.settings
            results["search"] = await measure_searches(
                worker, data, ids, tokens, plan, settings.memory_exact_search_threshold, paths
            )
            mark = lap("search_s", mark)
            if not args.search_only:
                # Remember again, into the loaded table: what a write costs once the table is big.
                results["writes_loaded"] = await measure_writes(env, worker, tokens, plan)
                mark = lap("writes_loaded_s", mark)
            results["config"] = run_config(plan, data, settings, overrides, args)
            results["versions"] = await versions(env)
    finally:
        await worker.close()
    timings["total_s"] = round(time.perf_counter() - began, 1)
    results["timings"] = timings
    results["machine"] = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
    }
    results["targets"] = report.targets(results)
    return results


async def load_dataset(env: BenchEnv, data: Dataset, results: dict[str, Any]) -> list[str]:
    """The search dataset, bulk-loaded into the agent's pinned space; its buckets' ids."""
    await pin_space(env)
    ids = bucket_ids(env, len(data.sizes))
    log(f"loading the search dataset ({data.rows} rows) by COPY, then the HNSW index")
    results["load"] = {k: round(v, 1) for k, v in (await load_memories(env, data, ids)).items()}
    return ids


def run_config(
    plan: Plan, data: Dataset, settings: Any, overrides: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    """What the run measured with: the dataset, the plan, the service's search settings."""
    return {
        "scale": plan.scale,
        "plan": asdict(plan),
        "rows": data.rows,
        "buckets": len(data.sizes),
        "seed": SEED,
        "k": K,
        "dimension": DIM,
        "pool_max_size": settings.pool_max_size,
        "memory_exact_search_threshold": settings.memory_exact_search_threshold,
        "memory_hnsw_ef_search": settings.memory_hnsw_ef_search,
        "memory_hnsw_max_scan_tuples": settings.memory_hnsw_max_scan_tuples,
        "overrides": overrides,
        "search_server": "in process" if args.workers is None else f"serve --workers {args.workers}",
        "search_connections": args.connections,
    }


async def restart_for_search(env: BenchEnv, workers: int | None, overrides: dict[str, Any]) -> None:
    """The in-process service, or `tokensvc serve --workers N` in child processes (--workers)."""
    if workers is None:
        await env.start_service(**overrides)
        return
    log(f"search phase: `tokensvc serve --workers {workers}` as a child process")
    await env.start_server_process(workers, log_name="search-server", **overrides)


@asynccontextmanager
async def worker_connections(worker: WorkerHandle) -> AsyncIterator[None]:
    """The load generator's pools and channels are closed while the database still runs."""
    try:
        yield
    finally:
        await worker.call("close")


async def pin_space(env: BenchEnv) -> None:
    """The agent's memory space pinned to the built-in hash embedder (what its first Remember does)."""
    su = await connect_as(env, "superuser")
    try:
        spec = HashEmbedder().spec
        await su.execute(
            "INSERT INTO tokensvc.memory_spaces (namespace, agent, embedder, model, dimension, normalized) "
            "VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING",
            NAMESPACE, AGENT, spec.name, spec.model, spec.dimension, spec.normalized,
        )  # fmt: skip
    finally:
        await su.close()


async def versions(env: BenchEnv) -> dict[str, str]:
    su = await connect_as(env, "superuser")
    try:
        row = await su.fetchrow(
            "SELECT current_setting('server_version') AS postgres, "
            "(SELECT extversion FROM pg_extension WHERE extname = 'vector') AS pgvector"
        )
    finally:
        await su.close()
    return {
        "postgres": row["postgres"],
        "pgvector": row["pgvector"],
        "grpcio": grpc.__version__,
        "asyncpg": version("asyncpg"),
        "langgraph-checkpoint-postgres": version("langgraph-checkpoint-postgres"),
        "psycopg": version("psycopg"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--scale",
        choices=sorted(PLANS),
        default="full",
        help="the dataset: quick (26k rows), full (100k, the default) or 1m (1M, search and writes ~30 min)",
    )
    parser.add_argument("--quick", action="store_true", help="the same as --scale quick (~2 minutes)")
    parser.add_argument("--name", help="results file name (default: the scale)")
    parser.add_argument("--set", action="append", default=[], metavar="SETTING=VALUE",
                        help="a tokensvc setting for this run, e.g. --set pool_max_size=16 (repeatable)")  # fmt: skip
    parser.add_argument(
        "--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md and the plot (full runs do)"
    )
    parser.add_argument("--docs", action="store_true", help="rewrite the docs from a --quick run too")
    parser.add_argument("--no-peer", action="store_true", help="skip the LangGraph peer")
    parser.add_argument("--search-only", action="store_true", help="skip writes, upload and verification")
    parser.add_argument(
        "--connections",
        type=int,
        default=1,
        metavar="N",
        help="the service path's searches over N mTLS connections, round robin (default 1: one launcher)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help=(
            "serve the search phase from `tokensvc serve --workers N`, a child process logging at INFO "
            "(default: the in-process service)"
        ),
    )
    args = parser.parse_args()
    if args.quick:
        args.scale = "quick"
    results = asyncio.run(run(args))
    name = args.name or args.scale
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{name}.json"
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(report.console_summary(results))
    log(f"wrote {out.relative_to(ROOT)}")
    if not args.no_docs and (args.scale == "full" or args.docs):
        report.write_docs(results, DOCS, PLOT, out.relative_to(ROOT))
        log(f"wrote {DOCS.relative_to(ROOT)} and {PLOT.relative_to(ROOT)}")
    sys.exit(0)


if __name__ == "__main__":
    main()
