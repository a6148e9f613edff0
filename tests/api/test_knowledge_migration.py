"""Knowledge-base migrations end to end (issue 16): a knowledge base moves from a 64-dimensional
`hash` embedder and recursive chunking to the embedded default model (384 dimensions) and fixed
chunking over mTLS gRPC while launchers search it and the control plane uploads to it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc

from tests.api.knowledge_support import RECURSIVE, VECTOR, new_ref, open_clients
from tests.api.test_embedding_migration import E5, FACTS, QUESTIONS, TIMEOUT, _fail, wait_for
from tests.cli.test_capability_cli import connection, tokensvc
from tests.support import SharedDatabase, audit_events, superuser
from tokensvc.auth.devpki import DevPaths
from tokensvc.v1 import admin_pb2, knowledge_pb2, migration_pb2

FIXED_16 = knowledge_pb2.ChunkingStrategy(kind=knowledge_pb2.CHUNKING_KIND_FIXED, chunk_size=16)
# About 120 words of prose on topics none of the questions asks about (and no times: the
# small model matches "when" questions to any time of day, measured).
FILLER = " ".join(
    [
        "Tomatoes grow best in full sun in well drained soil.",
        "The orchestra plays a new symphony with a large choir.",
        "Mountain trails are marked with red and white stripes.",
        "A good sourdough starter is made of flour and water.",
        "The museum's east wing shows sculptures from the bronze age.",
        "Cyclists in the city ride on protected lanes along the river.",
    ]
    * 2
)


def kb_request(ref: str, embedder: str = E5, **fields: Any) -> migration_pb2.StartEmbeddingMigrationRequest:
    return migration_pb2.StartEmbeddingMigrationRequest(
        knowledge_base=migration_pb2.KnowledgeBaseRef(namespace="default", ref=ref),
        embedder=embedder,
        **fields,
    )


async def test_a_knowledge_base_moves_to_the_default_model_and_new_chunks_while_it_serves(
    migrating: Any, database: SharedDatabase, dev: DevPaths
) -> None:
    service, _, stub = migrating
    async with open_clients(service, dev) as clients:
        manager = clients.manager()
        kb, bystander = new_ref(), new_ref()
        await manager.create(kb, RECURSIVE, 64, embedder="hash64")
        await manager.create(bystander, RECURSIVE, 64, embedder="hash64")
        for i, fact in enumerate(FACTS):
            await manager.upload(kb, f"fact-{i}", fact)
        for i in range(8):
            await manager.upload(kb, f"filler-{i}", f"roadmap filler {i}. {FILLER}")
        await manager.upload(bystander, "only", "the bystander's only document")
        searcher = clients.searcher([kb, bystander])

        dry = await stub.StartEmbeddingMigration(
            kb_request(kb, dry_run=True, chunking=FIXED_16), timeout=TIMEOUT
        )
        assert not dry.HasField("migration")
        assert dry.estimate.rows == 12
        assert (dry.estimate.source.dimension, dry.estimate.target.dimension) == (64, 384)

        failures: list[str] = []
        uploaded: list[str] = []
        stop = asyncio.Event()

        async def search_forever() -> int:
            done = 0
            while not stop.is_set():
                try:
                    found = await searcher.search("roadmap filler", [kb], top_k=50)
                    # Twelve documents, more chunks than that under either chunking.
                    if len({p.document_ref for p in found}) < 8:
                        failures.append(f"{len(found)} passages from too few documents")
                except grpc.aio.AioRpcError as exc:
                    failures.append(f"search: {exc.code()}: {exc.details()}")
                done += 1
            return done

        async def upload_forever() -> None:
            i = 0
            while not stop.is_set():
                try:
                    uploaded.append(f"during-{i}")
                    await manager.upload(kb, uploaded[-1], f"uploaded during the migration, number {i}")
                    # A new version of a document the backfill may have done already.
                    await manager.upload(kb, "filler-0", f"roadmap filler 0, version {i}. {FILLER}")
                except grpc.aio.AioRpcError as exc:
                    failures.append(f"upload: {exc.code()}: {exc.details()}")
                i += 1
                await asyncio.sleep(0.05)

        searchers = [asyncio.create_task(search_forever()) for _ in range(2)]
        writer = asyncio.create_task(upload_forever())
        started = await stub.StartEmbeddingMigration(kb_request(kb, chunking=FIXED_16), timeout=TIMEOUT)
        migration_id = started.migration.id
        assert started.migration.knowledge_base.ref == kb
        assert not started.migration.HasField("memory_space")
        assert started.migration.target_chunking.chunk_size == 16
        second = await _fail(stub.StartEmbeddingMigration(kb_request(kb), timeout=TIMEOUT))
        assert (second.code, second.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "MIGRATION_CONFLICT")

        await wait_for(stub, migration_id, migration_pb2.MIGRATION_PHASE_RETIRING)
        await asyncio.sleep(0.5)  # uploads and searches go on after the cutover too
        stop.set()
        searches = sum(await asyncio.gather(*searchers))
        await writer
        done = await wait_for(stub, migration_id, migration_pb2.MIGRATION_PHASE_SUCCEEDED)

        assert failures == []
        assert searches > 10
        assert (done.target.name, done.target.dimension, done.target_chunking.chunk_size) == (E5, 384, 16)
        base = await manager.get(kb)
        assert (base.embedder, base.dimension, base.chunking.kind, base.chunking.chunk_size) == (
            E5,
            384,
            knowledge_pb2.CHUNKING_KIND_FIXED,
            16,
        )
        # Every document uploaded before or during the migration is found by the new model.
        documents = {d.ref: d for page in await manager.list_documents(kb, page_size=500) for d in page}
        assert set(uploaded) | {f"fact-{i}" for i in range(4)} <= set(documents)
        for ref in [uploaded[0], uploaded[-1]]:
            number = ref.removeprefix("during-")
            found = await searcher.search(
                f"uploaded during the migration, number {number}", [kb], mode=VECTOR
            )
            assert found[0].document_ref == ref
        # The new model finds paraphrases the hash embedder could not.
        for question, index in QUESTIONS.items():
            found = await searcher.search(question, [kb], top_k=1, mode=VECTOR)
            assert found[0].document_ref == f"fact-{index}", question
        # The filler re-chunked at 16 words: 130 words, so 8 or more chunks each (64 before).
        assert documents["filler-3"].chunk_count >= 8

        async with superuser(database) as conn:
            rows = await conn.fetch(
                "SELECT generation, dimension, count(*) FROM tokensvc.chunks WHERE kb_ref = $1 GROUP BY 1, 2",
                kb,
            )
            assert [tuple(r) for r in rows] == [(1, 384, sum(d.chunk_count for d in documents.values()))]
            assert (
                await conn.fetchval(
                    "SELECT count(*) FROM tokensvc.documents WHERE kb_ref = $1 AND text IS NULL", kb
                )
                == 0
            )
            untouched = await conn.fetch(
                "SELECT generation, dimension FROM tokensvc.chunks WHERE kb_ref = $1", bystander
            )
            assert [tuple(r) for r in untouched] == [(0, 64)]
        assert [p.document_ref for p in await searcher.search("bystander", [bystander])] == ["only"]

        mine = await audit_events(
            service.port, dev, admin_pb2.AUDIT_EVENT_KIND_EMBEDDING_MIGRATION, migration_id
        )
        assert [e.action for e in mine] == [
            "finish embedding migration (succeeded)",
            "cut over embedding migration",
            "start embedding migration",
        ]
        assert all(f"knowledge_base:default/{kb}" in e.target for e in mine)


async def test_a_cancelled_knowledge_base_migration_leaves_the_base_as_it_was(
    migrating: Any, database: SharedDatabase, dev: DevPaths
) -> None:
    service, _, stub = migrating
    async with open_clients(service, dev) as clients:
        manager = clients.manager()
        kb = new_ref()
        await manager.create(kb, RECURSIVE, 16, embedder="hash64")
        for i in range(40):
            await manager.upload(kb, f"doc-{i:02}", f"document {i} {FILLER}")
        searcher = clients.searcher([kb])
        before = [(p.document_ref, p.chunk_index) for p in await searcher.search("document 7", [kb], top_k=5)]
        started = await stub.StartEmbeddingMigration(kb_request(kb), timeout=TIMEOUT)
        await stub.CancelEmbeddingMigration(
            migration_pb2.CancelEmbeddingMigrationRequest(id=started.migration.id), timeout=TIMEOUT
        )
        await wait_for(stub, started.migration.id, migration_pb2.MIGRATION_PHASE_CANCELLED)
        assert [
            (p.document_ref, p.chunk_index) for p in await searcher.search("document 7", [kb], top_k=5)
        ] == before
        assert (await manager.get(kb)).embedder == "hash64"
        async with superuser(database) as conn:
            generations = await conn.fetch(
                "SELECT DISTINCT generation FROM tokensvc.chunks WHERE kb_ref = $1", kb
            )
            assert [g[0] for g in generations] == [0]


async def test_knowledge_base_migrations_refuse_what_they_cannot_do(
    migrating: Any, database: SharedDatabase, dev: DevPaths
) -> None:
    service, launchers, stub = migrating
    async with open_clients(service, dev) as clients:
        manager = clients.manager()
        kb = new_ref()
        await manager.create(kb, RECURSIVE, 64, embedder="hash64")
        await manager.upload(kb, "doc", "a document")
        same = knowledge_pb2.ChunkingStrategy(kind=RECURSIVE, chunk_size=64)
        agent = launchers.new_agent()
        await launchers.caller(agent).remember("one memory")
        cases = [
            (kb_request(kb, embedder="hash64"), grpc.StatusCode.INVALID_ARGUMENT, "embedder"),
            (kb_request(kb, embedder="hash64", chunking=same), grpc.StatusCode.INVALID_ARGUMENT, "embedder"),
            (kb_request("Not/A/Ref"), grpc.StatusCode.INVALID_ARGUMENT, "knowledge_base.ref"),
            (
                kb_request(kb, chunking=knowledge_pb2.ChunkingStrategy(kind=RECURSIVE, chunk_size=4)),
                grpc.StatusCode.INVALID_ARGUMENT,
                "chunking",
            ),
            (
                migration_pb2.StartEmbeddingMigrationRequest(
                    memory_space=migration_pb2.MemorySpaceRef(namespace="default", agent=agent),
                    embedder=E5,
                    chunking=FIXED_16,
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
                "chunking",
            ),
        ]
        for request, code, field in cases:
            refused = await _fail(stub.StartEmbeddingMigration(request, timeout=TIMEOUT))
            assert refused.code == code, request
            assert any(v.startswith(field) for v in refused.field_violations), (request, refused)
        missing = await _fail(stub.StartEmbeddingMigration(kb_request(new_ref()), timeout=TIMEOUT))
        assert missing.code == grpc.StatusCode.NOT_FOUND
        # A document uploaded before texts were kept can be re-embedded, not re-chunked.
        async with superuser(database) as conn:
            await conn.execute("UPDATE tokensvc.documents SET text = NULL WHERE kb_ref = $1", kb)
        textless = await _fail(
            stub.StartEmbeddingMigration(kb_request(kb, chunking=FIXED_16), timeout=TIMEOUT)
        )
        assert (textless.code, textless.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "MIGRATION_CONFLICT")
        assert "1 documents" in textless.message

        # The CLI: a dry run of the knowledge base, as JSON.
        code, out, err = await tokensvc(
            "admin", "migrate", "start", "--namespace", "default", "--kb", kb, "--embedder", E5,
            "--dry-run", "--json", *connection(service, dev),
        )  # fmt: skip
        assert code == 0, err
        estimate = json.loads(out)["estimate"]
        assert (estimate["rows"], estimate["target"]["dimension"]) == ("1", 384)
