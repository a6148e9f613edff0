-- The text ranker stems: each memory space and knowledge base pins a text-search configuration
-- (default `english`; `simple` where stemming would hurt), and every row is indexed with its
-- space's or corpus's configuration. Before this migration every row was indexed with `simple`;
-- existing spaces and corpora take the new default and are re-indexed here. No row is lost:
-- only the generated tsvector column is rebuilt (the table is rewritten once).

ALTER TABLE tokensvc.memory_spaces ADD COLUMN text_config regconfig NOT NULL DEFAULT 'english';
ALTER TABLE tokensvc.knowledge_bases ADD COLUMN text_config regconfig NOT NULL DEFAULT 'english';

ALTER TABLE tokensvc.memories DROP COLUMN content_tsv;
ALTER TABLE tokensvc.memories ADD COLUMN text_config regconfig NOT NULL DEFAULT 'english';
ALTER TABLE tokensvc.memories
    ADD COLUMN content_tsv tsvector GENERATED ALWAYS AS (to_tsvector(text_config, content)) STORED;
CREATE INDEX memories_text ON tokensvc.memories USING gin (content_tsv);

ALTER TABLE tokensvc.chunks DROP COLUMN content_tsv;
ALTER TABLE tokensvc.chunks ADD COLUMN text_config regconfig NOT NULL DEFAULT 'english';
ALTER TABLE tokensvc.chunks
    ADD COLUMN content_tsv tsvector GENERATED ALWAYS AS (to_tsvector(text_config, text)) STORED;
CREATE INDEX chunks_text ON tokensvc.chunks USING gin (content_tsv);

-- A neighbour is the next row of the same document version: served by the primary key. Memories'
-- neighbours (the bucket's rows in creation order) are served by memories_newest.
