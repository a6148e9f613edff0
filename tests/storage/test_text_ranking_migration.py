"""Migration 0009 (stemmed text ranking) on a database populated under 0001-0008: every memory,
chunk, space and knowledge base is kept, and the rows are searchable with the new configuration."""

from __future__ import annotations

import pytest

from tests.storage.migration_support import connect, migrate_up_to
from tests.support import SharedDatabase
from tokensvc.storage.postgres import apply_schema_migrations

VECTOR = "[" + ",".join(["0.0625"] * 256) + "]"  # 256 x 0.0625^2 = 1: a unit vector
ROWS = 50
TENANT = (
    "SELECT set_config('tokensvc.namespace', 'ns', true), set_config('tokensvc.agent', 'agent', true), "
    "set_config('tokensvc.buckets', 'v1.abc', true), set_config('tokensvc.kbs', '*', true)"
)


async def test_migration_0009_keeps_every_row_and_makes_it_searchable_stemmed(
    database: SharedDatabase, scratch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn = await connect(database, "owner", scratch)
    try:
        await migrate_up_to(conn, 8, monkeypatch)
        async with conn.transaction():
            await conn.execute(TENANT)
            await conn.execute(
                "INSERT INTO tokensvc.memory_spaces VALUES ('ns', 'agent', 'hash', 'hash-v1', 256, true)"
            )
            await conn.execute(
                "INSERT INTO tokensvc.memories (bucket, id, namespace, agent, content, content_sha256, "
                "dimension, embedding) SELECT 'v1.abc', gen_random_uuid(), 'ns', 'agent', "
                "'The deployments were rolled back, take ' || i, sha256(i::text::bytea), 256, $1::vector "
                "FROM generate_series(1, $2) i",
                VECTOR,
                ROWS,
            )
            await conn.execute(
                "INSERT INTO tokensvc.knowledge_bases (namespace, ref, embedder, model, dimension, normalized, "
                "chunking, chunk_size, chunk_overlap) VALUES ('ns', 'kb', 'hash', 'hash-v1', 256, true, "
                "'fixed', 64, 0)"
            )
            await conn.execute(
                "INSERT INTO tokensvc.documents (namespace, kb_ref, ref, version, content_type, "
                "content_sha256, size_bytes, chunk_count) VALUES ('ns', 'kb', 'doc', 1, 'text/plain', "
                "'\\x00', 10, $1)",
                ROWS,
            )
            await conn.execute(
                "INSERT INTO tokensvc.chunks (namespace, kb_ref, doc_ref, version, chunk_index, text, "
                "start_offset, end_offset, dimension, embedding) SELECT 'ns', 'kb', 'doc', 1, i, "
                "'Rolling deployments of chunk ' || i, 0, 10, 256, $1::vector FROM generate_series(0, $2 - 1) i",
                VECTOR,
                ROWS,
            )
            # Indexed 'simple' under 0004: a stemmed word of the text does not match yet.
            assert (
                await conn.fetchval(
                    "SELECT count(*) FROM tokensvc.memories WHERE content_tsv @@ to_tsquery('english', 'deployment')"
                )
                == 0
            )

        applied = await apply_schema_migrations(conn, app_role="tokensvc_app")
        assert applied[0].version == 9  # and every later migration

        async with conn.transaction():
            await conn.execute(TENANT)
            counts = await conn.fetchrow(
                "SELECT (SELECT count(*) FROM tokensvc.memories) AS memories, "
                "(SELECT count(*) FROM tokensvc.chunks) AS chunks, "
                "(SELECT count(*) FROM tokensvc.memory_spaces) AS spaces, "
                "(SELECT count(*) FROM tokensvc.knowledge_bases) AS bases"
            )
            assert dict(counts) == {"memories": ROWS, "chunks": ROWS, "spaces": 1, "bases": 1}
            for table, column in (("memories", "content"), ("chunks", "text")):
                found = await conn.fetchval(
                    f"SELECT count(*) FROM tokensvc.{table} "  # noqa: S608 (constants)
                    "WHERE content_tsv @@ websearch_to_tsquery('english', 'deployment or roll')"
                )
                assert found == ROWS, table
                assert await conn.fetchval(
                    f"SELECT bool_and(text_config = 'english'::regconfig AND content_tsv = "  # noqa: S608
                    f"to_tsvector('english', {column})) FROM tokensvc.{table}"
                )
            assert await conn.fetchval("SELECT text_config::text FROM tokensvc.memory_spaces") == "english"
            assert await conn.fetchval("SELECT text_config::text FROM tokensvc.knowledge_bases") == "english"
            # The GIN indexes serve the new column.
            names = {
                row[0]
                for row in await conn.fetch(
                    "SELECT indexname FROM pg_indexes WHERE schemaname = 'tokensvc' AND indexdef LIKE '%gin%'"
                )
            }
            assert {"memories_text", "chunks_text"} <= names
    finally:
        await conn.close()
