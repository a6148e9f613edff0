-- Re-embedding migrations of knowledge bases (issue 16): a knowledge base moves to another
-- embedder, and optionally another chunking strategy, while it serves.
--
-- A knowledge base's chunks carry a generation; the base reads the chunks of its own. A migration
-- writes every current document's chunks of the next generation (re-chunked from the document's
-- stored text when the chunking changes, else the same chunks re-embedded), then cuts over by
-- pinning the target and bumping the base's generation: one row, one atomic switch. Searches
-- filter on (kb_ref, generation) pairs, so no search mixes generations. The old generation's
-- chunks are deleted afterwards.

ALTER TABLE tokensvc.knowledge_bases ADD COLUMN generation integer NOT NULL DEFAULT 0
    CHECK (generation >= 0);

-- `text`: the extracted text the chunks were cut from (NULL for documents uploaded before this
-- migration: they can be re-embedded, not re-chunked). `migrated_version` and
-- `migrated_chunk_count`: the version whose next-generation chunks the running migration has
-- written, and how many (reset when a migration starts).
ALTER TABLE tokensvc.documents
    ADD COLUMN text text,
    ADD COLUMN migrated_version bigint,
    ADD COLUMN migrated_chunk_count integer;

ALTER TABLE tokensvc.chunks ADD COLUMN generation integer NOT NULL DEFAULT 0;
ALTER TABLE tokensvc.chunks
    DROP CONSTRAINT chunks_pkey,
    ADD PRIMARY KEY (namespace, kb_ref, doc_ref, generation, version, chunk_index);
-- A search reads one generation of each base: with the generation in the index, a base's other
-- generation (a migration's, twice the rows for a while) is never read (measured: searches during
-- a migration took 1.9x as long when it was a filter).
CREATE INDEX chunks_kb_generation ON tokensvc.chunks (namespace, kb_ref, generation);
DROP INDEX tokensvc.chunks_kb;

-- A migration moves a memory space (namespace, agent) or a knowledge base (namespace, kb_ref).
ALTER TABLE tokensvc.embedding_migrations
    ALTER COLUMN agent DROP NOT NULL,
    ADD COLUMN kb_ref text,
    ADD COLUMN from_chunking text,
    ADD COLUMN from_chunk_size integer,
    ADD COLUMN from_chunk_overlap integer,
    ADD COLUMN to_chunking text CHECK (to_chunking IN ('fixed', 'recursive', 'markdown')),
    ADD COLUMN to_chunk_size integer,
    ADD COLUMN to_chunk_overlap integer,
    -- The knowledge-base backfill's cursor: documents in ref order.
    ADD COLUMN cursor_document text,
    ADD CONSTRAINT embedding_migrations_subject CHECK ((agent IS NULL) <> (kb_ref IS NULL)),
    ADD CONSTRAINT embedding_migrations_chunking CHECK (
        (kb_ref IS NULL) = (to_chunking IS NULL) AND (to_chunking IS NULL) = (to_chunk_size IS NULL)
        AND (to_chunking IS NULL) = (to_chunk_overlap IS NULL));
CREATE UNIQUE INDEX embedding_migrations_one_per_knowledge_base
    ON tokensvc.embedding_migrations (namespace, kb_ref)
    WHERE kb_ref IS NOT NULL AND state IN ('backfilling', 'paused', 'retiring', 'cancelling');
