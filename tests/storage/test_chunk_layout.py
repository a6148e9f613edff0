"""Where a chunk's bytes live (migrations 0025, 0026): its vector and tsvector stay in the row, so
an exact search, which computes every chunk's distance, and the text ranker, which reads every
matching chunk's tsvector, read no TOAST; the text, read for results alone, goes out of line. And
the text index holds a written chunk in its tree at once (0029): no pending list that every text
search would read."""

from __future__ import annotations

from pathlib import Path

import asyncpg
import numpy as np

from tests.storage.conformance.support import create_base, management, new_namespace, random_unit, upload
from tests.support import SharedDatabase, superuser
from tokensvc.knowledge.chunking import ChunkingStrategy, chunk_document
from tokensvc.knowledge.formats import extract_document
from tokensvc.storage.postgres.knowledge import PostgresKnowledgeStore

MANUAL = Path(__file__).parents[1] / "knowledge" / "fixtures" / "documents" / "r-intro.pdf"


async def test_the_chunks_of_a_real_manual_keep_their_vectors_and_tsvectors_in_the_row(
    pool: asyncpg.Pool, database: SharedDatabase
) -> None:
    # 256-word chunks of a third-party PDF manual: rows past the 2 kB toast threshold.
    text = extract_document(MANUAL.read_bytes(), "application/pdf").text
    chunks = chunk_document(text, ChunkingStrategy.from_stored("markdown", 256, 0))
    texts = [chunk.text for chunk in chunks[:60]]
    store = PostgresKnowledgeStore(pool)
    namespace = new_namespace()
    await create_base(store, namespace, "kb")
    rng = np.random.default_rng(25)
    await upload(store, namespace, "kb", "r-intro", texts, vectors=[random_unit(rng) for _ in texts])
    try:
        async with superuser(database) as conn:
            # The pages of the GIN index's pending list, merged now: none were pending.
            pending_pages = await conn.fetchval("SELECT gin_clean_pending_list('tokensvc.chunks_text')")
            # pg_column_toast_chunk_id: the value's TOAST id when it is stored out of line, else NULL.
            stored = await conn.fetchrow(
                "SELECT count(*) AS chunks, "
                "count(pg_column_toast_chunk_id(embedding)) AS vectors_out_of_line, "
                "count(pg_column_toast_chunk_id(content_tsv)) AS tsvectors_out_of_line, "
                "count(pg_column_toast_chunk_id(text)) AS texts_out_of_line "
                "FROM tokensvc.chunks WHERE namespace = $1",
                namespace,
            )
    finally:
        await store.delete_base(management(namespace), "kb")
    assert stored["chunks"] == len(texts) == 60
    assert stored["texts_out_of_line"] > 0, "the rows were small enough to stay whole: no layout was tested"
    assert stored["vectors_out_of_line"] == 0
    assert stored["tsvectors_out_of_line"] == 0
    assert pending_pages == 0
