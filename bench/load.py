"""Loading the dataset fast: binary COPY as the superuser, then the HNSW index built once.

The search dataset is written with asyncpg's `copy_records_to_table` (binary COPY) by the database
superuser — COPY FROM is refused on tables with row-level security for every other role, and the
superuser bypasses RLS — with the HNSW index dropped during the load and rebuilt afterwards by the
schema owner through the same SECURITY DEFINER function the service uses
(`ensure_memory_vector_index`), so the index is exactly the one tokensvc creates. Rows are the rows
`PostgresMemoryStore.insert` would write (bucket id from the pepper, NFC-trimmed content and its
SHA-256, metadata, dimension, unit vector); `created_at`/`content_tsv` come from column defaults.
This is what "build indexes after bulk loads" means in the design notes; the service's own write
path is measured separately (remember throughput).
"""

from __future__ import annotations

import json
import struct
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import asyncpg
import numpy as np

from bench.dataset import DIM, Dataset, content_of, metadata_of, sha256_of
from bench.env import AGENT, NAMESPACE, BenchEnv, connect_as
from tokensvc.auth.buckets import bucket_id

__all__ = [
    "MEMORY_COLUMNS",
    "binary_vectors",
    "bucket_ids",
    "copy_connection",
    "load_memories",
    "memory_records",
    "user_of",
]

MEMORY_COLUMNS = (
    "bucket",
    "id",
    "namespace",
    "agent",
    "content",
    "content_sha256",
    "metadata",
    "idempotency_key",
    "dimension",
    "embedding",
)
_HEADER = struct.pack(">HH", DIM, 0)


def user_of(b: int) -> str:
    return f"user-{b:04d}"


def bucket_ids(env: BenchEnv, count: int) -> list[str]:
    return [bucket_id(env.keyring, NAMESPACE, AGENT, user_of(b)) for b in range(count)]


def binary_vectors(vectors: np.ndarray) -> list[bytes]:
    """pgvector's binary wire format (dim, unused, big-endian float4s), vectorised with numpy."""
    big = np.ascontiguousarray(vectors, dtype=">f4")
    return [_HEADER + row.tobytes() for row in big]


async def copy_connection(
    env: BenchEnv, who: str = "superuser", database: str | None = None
) -> asyncpg.Connection:
    """A connection whose `vector` codec takes pre-encoded binary vectors (bytes) as they are."""
    conn = await asyncpg.connect(
        **env.conninfo(who, database), server_settings={"search_path": "tokensvc, public"}
    )
    await conn.set_type_codec(
        "vector", schema="public", encoder=lambda v: v, decoder=lambda v: v, format="binary"
    )
    return conn


def memory_records(
    data: Dataset, buckets: Sequence[int], ids_of_bucket: Sequence[str], encoded: Sequence[bytes]
) -> Iterator[tuple[Any, ...]]:
    for b in buckets:
        rows = data.bucket_rows(b)
        for j, i in enumerate(rows):
            content = content_of(b, j)
            yield (
                ids_of_bucket[b],
                uuid.UUID(data.ids[i]),
                NAMESPACE,
                AGENT,
                content,
                sha256_of(content),
                json.dumps(metadata_of(j)),
                None,
                DIM,
                encoded[i],
            )


async def load_memories(env: BenchEnv, data: Dataset, ids_of_bucket: Sequence[str]) -> dict[str, float]:
    """COPY every row (HNSW dropped), rebuild the HNSW index, ANALYZE; seconds per step."""
    timings: dict[str, float] = {}
    owner = await connect_as(env, "owner")
    conn = await copy_connection(env)
    try:
        await owner.execute(f"DROP INDEX IF EXISTS tokensvc.memories_hnsw_{DIM}")
        began = time.perf_counter()
        encoded = binary_vectors(data.vectors)
        records = list(memory_records(data, range(len(data.sizes)), ids_of_bucket, encoded))
        timings["encode_s"] = time.perf_counter() - began
        began = time.perf_counter()
        for start in range(0, len(records), 20_000):
            await conn.copy_records_to_table(
                "memories",
                schema_name="tokensvc",
                records=records[start : start + 20_000],
                columns=MEMORY_COLUMNS,
            )
        timings["copy_s"] = time.perf_counter() - began
        began = time.perf_counter()
        # The owner's session: enough memory for the graph, and one parallel worker (2 cores).
        await owner.execute("SET maintenance_work_mem = '1GB'")
        await owner.execute("SET max_parallel_maintenance_workers = 1")
        await owner.execute("SELECT tokensvc.ensure_memory_vector_index($1)", DIM)
        timings["hnsw_build_s"] = time.perf_counter() - began
        # The graphs' size: every partition's index of this dimension (0013: one per partition).
        size = await conn.fetchval(
            "SELECT coalesce(sum(pg_relation_size(inhrelid)), 0) FROM pg_inherits "
            "WHERE inhparent = to_regclass($1)",
            f"tokensvc.memories_hnsw_{DIM}",
        )
        timings["hnsw_mb"] = float(size) / 2**20
        began = time.perf_counter()
        await owner.execute("ANALYZE tokensvc.memories")
        await owner.execute("ANALYZE tokensvc.memory_spaces")
        timings["analyze_s"] = time.perf_counter() - began
    finally:
        await conn.close()
        await owner.close()
    return timings
