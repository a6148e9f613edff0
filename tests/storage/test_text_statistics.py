"""A knowledge base's BM25 statistics (migration 0027): what the runners count, and the text ranker
that reads them, which must rank the top rows exactly as BM25 over every row does while reading
only the rows that can reach them."""

from __future__ import annotations

import math
from pathlib import Path

import asyncpg
import numpy as np
import pytest

from tests.storage.conformance.ingestion_support import ready
from tests.storage.conformance.support import (
    create_base,
    launcher,
    management,
    new_namespace,
    random_unit,
    search_chunks,
    upload,
)
from tests.storage.conformance.test_embedding_migrations import claim
from tests.storage.conformance.test_knowledge_migrations import backfill, base_with, planned
from tests.support import SharedDatabase, superuser
from tokensvc.knowledge.chunking import ChunkingStrategy, chunk_document
from tokensvc.knowledge.formats import extract_document
from tokensvc.retrieval import BM25_B, BM25_K1, candidate_query, query_words
from tokensvc.storage.postgres.ingestion import PostgresIngestionStore
from tokensvc.storage.postgres.knowledge import PostgresKnowledgeStore
from tokensvc.storage.postgres.ranking import PRUNING_RANK
from tokensvc.storage.postgres.reembedding import PostgresEmbeddingMigrationStore
from tokensvc.storage.postgres.text_statistics import TextStatisticsPolicy, recount
from tokensvc.storage.reembedding_records import KnowledgeBaseMigration

MANUAL = Path(__file__).parents[1] / "knowledge" / "fixtures" / "documents" / "r-intro.pdf"
# Small enough for a test's base: bases from 100 chunks, lexemes in 2 % of them listed.
POLICY = TextStatisticsPolicy(min_base=100, min_share=0.02, min_chunks=5, drift=0.1)
QUESTIONS = [
    "how do I read data from a file into a data frame",
    "plot a histogram of the values",
    "fitting a linear regression model with lm",
    "objects in the workspace and how to remove them",
    "factors and their levels for categorical data",
    "the data",  # every term common
    "quaternion hyperplane",  # nothing matches
    "don't 'quote' O'Brien's back\\slash data.frame() $x & y | !z <-> :*",  # tsquery syntax, quoted
]
KEY = ("doc_ref", "version", "chunk_index")


def manual_chunks() -> list[str]:
    text = extract_document(MANUAL.read_bytes(), "application/pdf").text
    return [chunk.text for chunk in chunk_document(text, ChunkingStrategy.from_stored("markdown", 64, 0))]


async def fill(
    store: PostgresKnowledgeStore,
    namespace: str,
    texts: list[str],
    per_document: int = 50,
    name: str = "part",
) -> None:
    rng = np.random.default_rng(27)
    for start in range(0, len(texts), per_document):
        part = texts[start : start + per_document]
        await upload(
            store, namespace, "kb", f"{name}-{start:05d}", part, vectors=[random_unit(rng) for _ in part]
        )


async def exact_bm25(
    conn: asyncpg.Connection, namespace: str, query: str, k: int
) -> list[tuple[object, ...]]:
    """The top k of BM25 over every chunk of the base, from its rows alone (the oracle)."""
    rows = await conn.fetch(
        """
        WITH terms AS (SELECT DISTINCT lexeme FROM unnest(to_tsvector('english', $2))),
        base AS (SELECT count(*)::float8 AS n, avg(length(content_tsv))::float8 AS avgdl
                 FROM tokensvc.chunks WHERE namespace = $1 AND kb_ref = 'kb'),
        postings AS (SELECT c.doc_ref, c.version, c.chunk_index, length(c.content_tsv) AS dl, u.lexeme,
                            cardinality(u.positions) AS tf
                     FROM tokensvc.chunks c CROSS JOIN LATERAL unnest(c.content_tsv) u
                     WHERE c.namespace = $1 AND c.kb_ref = 'kb' AND u.lexeme IN (SELECT lexeme FROM terms)),
        df AS (SELECT lexeme, count(*)::float8 AS df FROM postings GROUP BY lexeme)
        SELECT p.doc_ref, p.version, p.chunk_index,
               sum(ln(1 + (b.n - df.df + 0.5) / (df.df + 0.5)) * p.tf * ($4::float8 + 1)
                   / (p.tf + $4::float8 * (1 - $5::float8 + $5::float8 * p.dl / b.avgdl))) AS score
        FROM postings p JOIN df USING (lexeme) CROSS JOIN base b
        GROUP BY p.doc_ref, p.version, p.chunk_index
        ORDER BY score DESC, p.doc_ref, p.version, p.chunk_index LIMIT $3
        """,
        namespace,
        query,
        k,
        BM25_K1,
        BM25_B,
    )
    return [(row["doc_ref"], row["version"], row["chunk_index"], row["score"]) for row in rows]


async def text_top(
    store: PostgresKnowledgeStore, namespace: str, query: str, *, rows: int, k: int
) -> list[tuple[object, ...]]:
    question = candidate_query(vector=None, text=query, k=k, rows=rows, exact=True, text_config="english")
    found = await search_chunks(store, launcher(namespace, "kb"), ["kb"], question)
    ranked = sorted((c for c in found if c.text_rank), key=lambda c: c.text_rank)
    return [(c.item.doc_ref, c.item.version, c.item.chunk_index, c.text_score) for c in ranked]


@pytest.fixture
async def store(pool: asyncpg.Pool) -> PostgresKnowledgeStore:
    return PostgresKnowledgeStore(pool)


async def test_a_bases_statistics_are_its_chunk_count_length_and_common_lexemes(
    store: PostgresKnowledgeStore, runner_pool: asyncpg.Pool, database: SharedDatabase
) -> None:
    texts = manual_chunks()
    namespace = new_namespace()
    await create_base(store, namespace, "kb", text_config="english")
    try:
        await fill(store, namespace, texts[:300])
        assert await recount(runner_pool, namespace, "kb", POLICY)
        assert not await recount(runner_pool, namespace, "kb", POLICY), "nothing changed: not counted again"
        async with superuser(database) as conn:
            stats = await conn.fetchrow(
                "SELECT * FROM tokensvc.text_statistics WHERE namespace = $1", namespace
            )
            listed = dict(
                await conn.fetch(
                    "SELECT lexeme, chunks FROM tokensvc.common_lexemes WHERE namespace = $1", namespace
                )
            )
            truth = dict(
                await conn.fetch(
                    # ts_stat: PostgreSQL's own count of each lexeme's rows (ndoc).
                    "SELECT word, ndoc FROM ts_stat(format('SELECT content_tsv FROM tokensvc.chunks "
                    "WHERE namespace = %L', $1::text)) WHERE ndoc >= $2",
                    namespace,
                    math.ceil(0.02 * 300),
                )
            )
            mean = await conn.fetchval(
                "SELECT avg(length(content_tsv)) FROM tokensvc.chunks WHERE namespace = $1", namespace
            )
        assert (stats["chunks"], stats["generation"], stats["min_chunks"]) == (300, 0, 6)
        assert stats["avg_length"] == pytest.approx(float(mean))
        assert listed == truth
        assert len(listed) > 50

        await fill(
            store, namespace, texts[300:320], per_document=20, name="more"
        )  # 7 % more: within the drift
        assert not await recount(runner_pool, namespace, "kb", POLICY)
        await fill(store, namespace, texts[320:340], per_document=20, name="yet-more")  # 13 % more
        assert await recount(runner_pool, namespace, "kb", POLICY)
        async with superuser(database) as conn:
            assert (
                await conn.fetchval(
                    "SELECT chunks FROM tokensvc.text_statistics WHERE namespace = $1", namespace
                )
                == 340
            )
    finally:
        await store.delete_base(management(namespace), "kb")
    async with superuser(database) as conn:
        left = await conn.fetchval(
            "SELECT (SELECT count(*) FROM tokensvc.text_statistics WHERE namespace = $1) "
            "+ (SELECT count(*) FROM tokensvc.common_lexemes WHERE namespace = $1)",
            namespace,
        )
    assert left == 0, "a base's deletion takes its statistics"


async def test_a_small_base_keeps_no_statistics(
    store: PostgresKnowledgeStore, runner_pool: asyncpg.Pool
) -> None:
    namespace = new_namespace()
    await create_base(store, namespace, "kb", text_config="english")
    try:
        await fill(store, namespace, manual_chunks()[:99])
        assert not await recount(runner_pool, namespace, "kb", POLICY)
    finally:
        await store.delete_base(management(namespace), "kb")


async def test_with_statistics_the_text_rankers_top_rows_are_exact_bm25s(
    store: PostgresKnowledgeStore, runner_pool: asyncpg.Pool, database: SharedDatabase
) -> None:
    texts = manual_chunks()
    assert len(texts) > 400
    namespace = new_namespace()
    await create_base(store, namespace, "kb", text_config="english")
    try:
        await fill(store, namespace, texts)
        assert await recount(runner_pool, namespace, "kb", POLICY)
        # And 40 queries of 3 to 8 words drawn from the manual's own chunks: mixes of rare and
        # common terms the hand-written ones may not reach.
        rng = np.random.default_rng(37)
        drawn = []
        for _ in range(40):
            words = texts[int(rng.integers(len(texts)))].split()
            drawn.append(
                " ".join(rng.choice(words, size=min(len(words), int(rng.integers(3, 9))), replace=False))
            )
        async with superuser(database) as conn:
            for question in [*QUESTIONS, *drawn]:
                oracle = await exact_bm25(conn, namespace, " ".join(query_words(question)), PRUNING_RANK)
                got = (await text_top(store, namespace, question, rows=len(texts), k=50))[:PRUNING_RANK]
                assert [row[:3] for row in got] == [row[:3] for row in oracle], question
                assert [row[3] for row in got] == pytest.approx([row[3] for row in oracle]), question
    finally:
        await store.delete_base(management(namespace), "kb")


async def test_rows_that_cannot_reach_the_top_are_not_read(
    store: PostgresKnowledgeStore, runner_pool: asyncpg.Pool
) -> None:
    # 12 chunks say "zebra" three times, 200 say "apple" once, 288 neither. For "zebra apple" the
    # tenth zebra chunk's score is above anything "apple" alone can add (idf * (k1 + 1)), so the
    # text ranker never reads the chunks holding only "apple": it returns the 12, where without
    # statistics it scores every matching chunk and fills its k.
    texts = [
        *(f"zebra stripes zebra herd zebra note {i}" for i in range(12)),
        *(f"apple orchard harvest record {i}" for i in range(200)),
        *(f"unrelated filler line {i}" for i in range(288)),
    ]
    namespace = new_namespace()
    await create_base(store, namespace, "kb", text_config="english")
    try:
        await fill(store, namespace, texts)
        before = await text_top(store, namespace, "zebra apple", rows=500, k=50)
        assert len(before) == 50, "without statistics every matching chunk is scored"
        assert await recount(runner_pool, namespace, "kb", POLICY)

        after = await text_top(store, namespace, "zebra apple", rows=500, k=50)

        assert len(after) == 12
        assert [row[:3] for row in after] == [row[:3] for row in before[:12]]
    finally:
        await store.delete_base(management(namespace), "kb")


async def test_the_serving_role_reads_statistics_but_never_writes_them(
    store: PostgresKnowledgeStore, pool: asyncpg.Pool
) -> None:
    namespace = new_namespace()
    await create_base(store, namespace, "kb", text_config="english")
    try:
        async with pool.acquire() as conn, conn.transaction():
            await conn.execute(
                "SELECT set_config('tokensvc.namespace', $1, true), set_config('tokensvc.kbs', '*', true)",
                namespace,
            )
            assert await conn.fetchval("SELECT count(*) FROM text_statistics") == 0
            for statement in (
                "INSERT INTO text_statistics (namespace, kb_ref, generation, chunks, avg_length, min_chunks) "
                "VALUES ($1, 'kb', 0, 1, 1, 1)",
                "SELECT count_text_statistics($1, 'kb', 1, 0.1, 1, 0.1)",
            ):
                with pytest.raises(asyncpg.InsufficientPrivilegeError):
                    async with conn.transaction():
                        await conn.execute(statement, namespace)
    finally:
        await store.delete_base(management(namespace), "kb")


async def test_a_version_that_lands_counts_its_bases_statistics_when_they_are_stale(
    store: PostgresKnowledgeStore, pool: asyncpg.Pool, runner_pool: asyncpg.Pool, database: SharedDatabase
) -> None:
    ingestion = PostgresIngestionStore(pool, runner_pool, statistics=POLICY)
    texts = manual_chunks()
    namespace = new_namespace()
    await create_base(store, namespace, "kb", text_config="english")

    async def counted() -> int | None:
        async with superuser(database) as conn:
            value = await conn.fetchval(
                "SELECT chunks FROM tokensvc.text_statistics WHERE namespace = $1", namespace
            )
        return None if value is None else int(value)

    try:
        await ready(ingestion, namespace, "small", texts[:60])
        assert await counted() is None, "60 chunks: below the policy's 100"
        await ready(ingestion, namespace, "large", texts[60:160])
        assert await counted() == 160
        await ready(ingestion, namespace, "note", texts[160:165])
        assert await counted() == 160, "3 % more: the last count stands"
        await ready(ingestion, namespace, "appendix", texts[165:200])
        assert await counted() == 200
    finally:
        await store.delete_base(management(namespace), "kb")


async def test_a_cutover_counts_the_new_generations_statistics(
    store: PostgresKnowledgeStore, pool: asyncpg.Pool, runner_pool: asyncpg.Pool, database: SharedDatabase
) -> None:
    migrations = PostgresEmbeddingMigrationStore(pool, runner_pool=runner_pool, statistics=POLICY)
    namespace, _ = await base_with(store, documents=40)  # 120 chunks
    try:
        assert await recount(runner_pool, namespace, "kb", POLICY)
        created = await migrations.create(planned(namespace, "kb"))
        assert created is not None
        runner = "runner-statistics"
        migration = await backfill(migrations, await claim(migrations, runner, created.id), runner)
        assert isinstance(migration, KnowledgeBaseMigration)

        assert await migrations.cut_over(migration, runner)

        async with superuser(database) as conn:
            counted = await conn.fetch(
                "SELECT generation, chunks FROM tokensvc.text_statistics WHERE namespace = $1", namespace
            )
        assert [tuple(row) for row in counted] == [(1, 120)], "the new generation's, the old one's gone"
    finally:
        await store.delete_base(management(namespace), "kb")
