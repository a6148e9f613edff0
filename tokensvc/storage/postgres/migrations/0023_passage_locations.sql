-- Where a passage is in its original document (issue 37): the page, slide or rows a chunk came
-- from, and the document's source spans a re-chunking migration cuts its new chunks against.
--
-- `chunks.location`: {"pages": [first, last]}, {"slides": [first, last]} or
-- {"sheet": name, "rows": [first, last]} (a key only where the format has it); NULL where it has
-- none (plain text, Markdown, HTML) and for chunks written before this migration.
-- `documents.source_spans`: [[start, end, page, slide, sheet, row], ...] in text order, NULL when
-- the format has none.
ALTER TABLE tokensvc.chunks ADD COLUMN location jsonb;
ALTER TABLE tokensvc.documents ADD COLUMN source_spans jsonb;

-- The runner's reads of a knowledge base's backfill return these too: a function's result columns
-- change only by dropping it (functions/reembedding_knowledge.sql defines them anew, after this).
DROP FUNCTION IF EXISTS tokensvc.kb_migration_pending(uuid, text, text, integer);
DROP FUNCTION IF EXISTS tokensvc.kb_migration_chunks(uuid, text, text[], bigint[]);
