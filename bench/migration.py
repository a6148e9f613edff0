"""Re-embedding migration: its throughput against the target embedder alone, and search latency
during a migration against the latency without one (issue 16).

    .venv/bin/python -m bench.migration [--rows 3000] [--users 30] [--searches 300] [--documents 1000]

A memory space of `--rows` memories over `--users` buckets is written with a 64-dimensional `hash`
embedder, then migrated to the embedded default model (multilingual-e5-small, 384 dimensions) by
the service's own runner, in process, over the embedded PostgreSQL. Measured in the same run:

- the target embedder alone: the same memories embedded in batches of its own size, with the
  service idle (the floor a migration is compared with);
- the migration, with nothing else running: memories re-embedded per second from its start to
  its cutover (its runner embeds, writes each batch and its progress in one transaction, catches
  up, cuts over);
- on a second, fresh database: searches of the space (VECTOR mode, query text, concurrency 1)
  before a migration (the table vacuumed and 50 searches made first) and while one backfills;
- the same for a knowledge base of `--documents` documents (three 16-word chunks each, hash64):
  its migration's chunks per second against the target alone on the same chunk texts, and
  SearchKnowledge latency before and during its migration.

Results go to bench/results/migration.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from bench.client import mtls_channel
from bench.env import BenchEnv, bench_env, connect_as
from bench.stats import latency_summary, percentile
from tokensvc.embedders import Demand, WorkClass
from tokensvc.knowledge.chunking import ChunkingStrategy, chunk_document
from tokensvc.reembedding import batch_size_of
from tokensvc.v1 import (
    common_pb2,
    knowledge_pb2,
    knowledge_pb2_grpc,
    memory_pb2,
    memory_pb2_grpc,
    migration_pb2,
    migration_pb2_grpc,
)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
TARGET = "multilingual-e5-small"
TOPICS = [
    "deploys",
    "the staging cluster",
    "invoices",
    "the on-call rota",
    "customer feedback",
    "the roadmap",
]


def log(message: str) -> None:
    print(f"[migration {time.strftime('%H:%M:%S')}] {message}", flush=True)


async def embedder_alone(target: Any, size: int, texts: list[str]) -> float:
    """Memories per second the target embeds in batches of its own size, nothing else running."""
    sample = texts[: 10 * size]
    demand = Demand.of(WorkClass.BULK, "bench")  # a migration's class
    await target.embed_documents(sample[:size], demand)  # warm
    began = time.perf_counter()
    for start in range(0, len(sample), size):
        await target.embed_documents(sample[start : start + size], demand)
    return len(sample) / (time.perf_counter() - began)


def content(user: int, i: int) -> str:
    return f"user {user} noted on day {i} that {TOPICS[i % len(TOPICS)]} changed again ({i * 7 % 13} items)"


@dataclass
class Space:
    """The space to migrate, loaded, and the channels to reach it."""

    env: BenchEnv
    memory: memory_pb2_grpc.MemoryServiceStub
    migrations: migration_pb2_grpc.MigrationServiceStub
    tokens: list[str]
    channels: list[grpc.aio.Channel]

    async def search(self, i: int) -> float:
        meta = (("authorization", f"Bearer {self.tokens[i % len(self.tokens)]}"),)
        request = memory_pb2.SearchMemoriesRequest(
            query_text=TOPICS[i % len(TOPICS)], top_k=10, mode=common_pb2.SEARCH_MODE_VECTOR
        )
        t0 = time.perf_counter()
        await self.memory.SearchMemories(request, metadata=meta, timeout=60)
        return (time.perf_counter() - t0) * 1000

    async def migrate(self, during: list[float] | None) -> tuple[int, float]:
        """Migrate to TARGET (searching meanwhile when `during` is a list): (rows, seconds to cutover)."""
        started = await self.migrations.StartEmbeddingMigration(
            migration_pb2.StartEmbeddingMigrationRequest(
                memory_space=migration_pb2.MemorySpaceRef(namespace="default", agent="dev-agent"),
                embedder=TARGET,
            ),
            timeout=120,
        )
        request = migration_pb2.GetEmbeddingMigrationRequest(id=started.migration.id)
        i = 0
        while True:
            got = await self.migrations.GetEmbeddingMigration(request, timeout=60)
            if got.migration.phase != migration_pb2.MIGRATION_PHASE_BACKFILLING:
                break
            if during is None:
                await asyncio.sleep(0.1)
                continue
            for _ in range(10):
                during.append(await self.search(i))
                i += 1
        conn = await connect_as(self.env, "superuser")
        try:
            row = await conn.fetchrow(
                "SELECT rows_done, extract(epoch FROM cut_over_at - created_at) AS seconds "
                "FROM tokensvc.embedding_migrations WHERE id = $1",
                started.migration.id,
            )
        finally:
            await conn.close()
        assert row is not None
        return int(row["rows_done"]), float(row["seconds"])

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close(grace=None)


@asynccontextmanager
async def loaded_space(rows: int, users: int) -> AsyncIterator[Space]:
    """A fresh database and service with `rows` memories over `users` buckets, written with hash64."""
    per_user = rows // users
    async with bench_env() as env:
        embedders = env.root / "embedders.toml"
        embedders.write_text('[embedders.hash64]\nkind = "hash"\ndimension = 64\n', encoding="utf-8")
        service = await env.start_service(
            embedders_file=embedders,
            memory_embedder="hash64",
            memory_space_cache_seconds=1.0,
            migration_retire_seconds=3.0,
        )
        ca = env.dev.ca_cert.read_bytes()
        channels = [
            mtls_channel(service.port, ca, cert.read_bytes(), key.read_bytes())
            for cert, key in (env.dev.client("launcher"), env.dev.client("control-plane"))
        ]
        space = Space(
            env,
            memory_pb2_grpc.MemoryServiceStub(channels[0]),
            migration_pb2_grpc.MigrationServiceStub(channels[1]),
            [env.capability(user=f"user-{u}", per_user=True, long_term_memory=True) for u in range(users)],
            channels,
        )
        try:
            log(f"remembering {per_user * users} memories over {users} buckets (hash64)")
            for u, token in enumerate(space.tokens):
                meta = (("authorization", f"Bearer {token}"),)
                for start in range(0, per_user, 100):
                    items = [
                        memory_pb2.RememberItem(content=content(u, i))
                        for i in range(start, min(per_user, start + 100))
                    ]
                    await space.memory.Remember(
                        memory_pb2.RememberRequest(items=items), metadata=meta, timeout=60
                    )
            yield space
        finally:
            await space.close()


KB = "bench-kb"
FIXED_16 = knowledge_pb2.ChunkingStrategy(kind=knowledge_pb2.CHUNKING_KIND_FIXED, chunk_size=16)


def document(d: int) -> str:
    """48 words: three chunks of 16."""
    return " ".join(f"{content(d % 30, d + k)}." for k in range(3))


@dataclass
class Base:
    """The knowledge base to migrate, loaded, and the channels to reach it."""

    env: BenchEnv
    knowledge: knowledge_pb2_grpc.KnowledgeServiceStub
    migrations: migration_pb2_grpc.MigrationServiceStub
    token: str
    channels: list[grpc.aio.Channel]

    async def search(self, i: int) -> float:
        request = knowledge_pb2.SearchKnowledgeRequest(
            knowledge_base_refs=[KB],
            query_text=TOPICS[i % len(TOPICS)],
            top_k=10,
            mode=common_pb2.SEARCH_MODE_VECTOR,
        )
        t0 = time.perf_counter()
        await self.knowledge.SearchKnowledge(
            request, metadata=(("authorization", f"Bearer {self.token}"),), timeout=60
        )
        return (time.perf_counter() - t0) * 1000

    async def migrate(self, during: list[float] | None) -> tuple[int, float]:
        """Migrate to TARGET (searching meanwhile when `during` is a list): (chunks, seconds to cutover)."""
        started = await self.migrations.StartEmbeddingMigration(
            migration_pb2.StartEmbeddingMigrationRequest(
                knowledge_base=migration_pb2.KnowledgeBaseRef(namespace="default", ref=KB), embedder=TARGET
            ),
            timeout=120,
        )
        request = migration_pb2.GetEmbeddingMigrationRequest(id=started.migration.id)
        i = 0
        while True:
            got = await self.migrations.GetEmbeddingMigration(request, timeout=60)
            if got.migration.phase != migration_pb2.MIGRATION_PHASE_BACKFILLING:
                break
            if during is None:
                await asyncio.sleep(0.1)
                continue
            for _ in range(10):
                during.append(await self.search(i))
                i += 1
        conn = await connect_as(self.env, "superuser")
        try:
            row = await conn.fetchrow(
                "SELECT (SELECT count(*) FROM tokensvc.chunks WHERE kb_ref = $2 AND generation = 1) AS chunks, "
                "extract(epoch FROM cut_over_at - created_at) AS seconds "
                "FROM tokensvc.embedding_migrations WHERE id = $1",
                started.migration.id,
                KB,
            )
        finally:
            await conn.close()
        assert row is not None
        return int(row["chunks"]), float(row["seconds"])


@asynccontextmanager
async def loaded_base(documents: int) -> AsyncIterator[Base]:
    """A fresh database and service with a knowledge base of `documents` documents, hash64."""
    async with bench_env() as env:
        embedders = env.root / "embedders.toml"
        embedders.write_text('[embedders.hash64]\nkind = "hash"\ndimension = 64\n', encoding="utf-8")
        service = await env.start_service(
            embedders_file=embedders, memory_space_cache_seconds=1.0, migration_retire_seconds=3.0
        )
        ca = env.dev.ca_cert.read_bytes()
        channels = [
            mtls_channel(service.port, ca, cert.read_bytes(), key.read_bytes())
            for cert, key in (env.dev.client("launcher"), env.dev.client("control-plane"))
        ]
        manager = knowledge_pb2_grpc.KnowledgeServiceStub(channels[1])
        base = Base(
            env,
            knowledge_pb2_grpc.KnowledgeServiceStub(channels[0]),
            migration_pb2_grpc.MigrationServiceStub(channels[1]),
            env.capability(knowledge_bases=[KB]),
            channels,
        )
        try:
            await manager.CreateKnowledgeBase(
                knowledge_pb2.CreateKnowledgeBaseRequest(
                    namespace="default", ref=KB, embedder="hash64", chunking=FIXED_16
                ),
                timeout=60,
            )
            log(f"uploading {documents} documents (hash64, fixed 16-word chunks)")
            for d in range(documents):
                header = knowledge_pb2.UploadDocumentHeader(
                    namespace="default",
                    knowledge_base_ref=KB,
                    document_ref=f"doc-{d:05}",
                    content_type="text/plain",
                    wait_until_ready=True,
                )
                parts = [
                    knowledge_pb2.UploadDocumentRequest(header=header),
                    knowledge_pb2.UploadDocumentRequest(content=document(d).encode()),
                ]
                await manager.UploadDocument(iter(parts), timeout=60)
            yield base
        finally:
            for channel in channels:
                await channel.close(grace=None)


async def run_knowledge(documents: int, searches: int) -> dict[str, Any]:
    async with loaded_base(documents) as base:
        assert base.env.service is not None
        assert base.env.service.embedders is not None
        target = base.env.service.embedders.get(TARGET)
        size = batch_size_of(target)
        strategy = ChunkingStrategy.from_stored("fixed", 16, 0)
        texts = [c.text for d in range(documents) for c in chunk_document(document(d), strategy)]
        alone = await embedder_alone(target, size, texts)
        log(f"{TARGET} alone: {alone:.1f} chunks/s (batches of {size})")
        chunks, seconds = await base.migrate(None)
        rate = chunks / seconds
        log(f"knowledge-base migration alone: {chunks} chunks in {seconds:.1f} s = {rate:.1f}/s")
    async with loaded_base(documents) as base:
        await settled(base.env, "chunks", base.search)
        before = [await base.search(i) for i in range(searches)]
        log(f"knowledge searches without a migration: p50 {percentile(before, 50):.2f} ms")
        during: list[float] = []
        await base.migrate(during)
        log(f"knowledge searches during one: p50 {percentile(during, 50):.2f} ms over {len(during)}")
    return {
        "documents": documents,
        "chunks": chunks,
        "target_alone_items_per_s": round(alone, 1),
        "migration_seconds": round(seconds, 1),
        "migration_items_per_s": round(rate, 1),
        "migration_over_target_alone": round(rate / alone, 3),
        "search_c1_without_migration": latency_summary(before),
        "search_c1_during_migration": latency_summary(during),
        "search_p50_during_over_without": round(percentile(during, 50) / percentile(before, 50), 3),
    }


async def settled(env: BenchEnv, table: str, search: Any) -> None:
    """A freshly loaded table vacuumed and analysed, and searched a while, before the baseline:
    its first readers would otherwise pay for setting hint bits (docs/benchmarks.md, issue 15)."""
    conn = await connect_as(env, "superuser")
    try:
        await conn.execute(f"VACUUM ANALYZE tokensvc.{table}")
    finally:
        await conn.close()
    for i in range(50):
        await search(i)


async def run(rows: int, users: int, searches: int) -> dict[str, Any]:
    # Throughput: a migration with nothing else running, against the target embedder alone.
    async with loaded_space(rows, users) as space:
        assert space.env.service is not None
        assert space.env.service.embedders is not None
        target = space.env.service.embedders.get(TARGET)
        size = batch_size_of(target)
        texts = [content(u, i) for u in range(users) for i in range(rows // users)]
        alone = await embedder_alone(target, size, texts)
        log(f"{TARGET} alone: {alone:.1f} memories/s (batches of {size})")
        migrated, seconds = await space.migrate(None)
        rate = migrated / seconds
        log(f"migration alone: {migrated} memories in {seconds:.1f} s = {rate:.1f}/s")
    # Latency: searches of the space before and while it migrates (a fresh database again).
    async with loaded_space(rows, users) as space:
        await settled(space.env, "memories", space.search)
        before = [await space.search(i) for i in range(searches)]
        log(f"searches without a migration: p50 {percentile(before, 50):.2f} ms")
        during: list[float] = []
        await space.migrate(during)
        log(f"searches during one: p50 {percentile(during, 50):.2f} ms over {len(during)}")
    return {
        "rows": rows // users * users,
        "buckets": users,
        "source": "hash (64 dimensions)",
        "target": f"{TARGET} (384 dimensions)",
        "target_alone_items_per_s": round(alone, 1),
        "batch_size": size,
        "migration_seconds": round(seconds, 1),
        "migration_items_per_s": round(rate, 1),
        "migration_over_target_alone": round(rate / alone, 3),
        "search_c1_without_migration": latency_summary(before),
        "search_c1_during_migration": latency_summary(during),
        "search_p50_during_over_without": round(percentile(during, 50) / percentile(before, 50), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=3000, help="memories in the space (default %(default)s)")
    parser.add_argument(
        "--users", type=int, default=30, help="buckets they are spread over (default %(default)s)"
    )
    parser.add_argument(
        "--searches", type=int, default=300, help="searches without a migration (default %(default)s)"
    )
    parser.add_argument(
        "--documents", type=int, default=1000, help="documents in the knowledge base (default %(default)s)"
    )
    args = parser.parse_args()
    results = asyncio.run(run(args.rows, args.users, args.searches))
    results["knowledge_base"] = asyncio.run(run_knowledge(args.documents, args.searches))
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "migration.json"
    out.write_text(json.dumps(results, indent=1) + "\n")
    log(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
