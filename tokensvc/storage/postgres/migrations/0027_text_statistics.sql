-- BM25 statistics of a knowledge base kept outside the query (issue 37 "Speed", issue 39 item 3).
--
-- The text ranker weighs each query term by its document frequency among the base's chunks. It
-- counted it among the rows matching any query term, up to 10,000 of them: on a large base that is
-- a scan of every row holding a common word, per query, and past the cap the counts and N were
-- those of an arbitrary sample (a 60,000-chunk base of third-party documents: top 10 agreeing
-- with exact BM25 for 0.67 of the questions). Now a base's chunk count, mean length and the
-- document frequency of its common lexemes (in at least `min_chunks` chunks) are counted in the
-- background per generation (`count_text_statistics`, functions/text_statistics.sql), and a
-- search reads the rows of its rare terms and of the common ones that can still change its top
-- results (storage/postgres/ranking.py).
--
-- Both tables are keyed by namespace first and co-located with the knowledge bases on Citus; a
-- base's deletion cascades to them. The serving role reads them (row-level security as on every
-- tenant table); only the owner's function writes them.

CREATE TABLE tokensvc.text_statistics (
    namespace  text        NOT NULL,
    kb_ref     text        NOT NULL,
    generation integer     NOT NULL,
    chunks     bigint      NOT NULL CHECK (chunks >= 0),  -- BM25's N
    avg_length float8      NOT NULL,  -- mean distinct lexemes per chunk (BM25's avgdl)
    min_chunks integer     NOT NULL CHECK (min_chunks >= 1),  -- lexemes in this many chunks are listed
    counted_at timestamptz NOT NULL DEFAULT statement_timestamp(),
    PRIMARY KEY (namespace, kb_ref, generation),
    FOREIGN KEY (namespace, kb_ref) REFERENCES tokensvc.knowledge_bases ON DELETE CASCADE
);

CREATE TABLE tokensvc.common_lexemes (
    namespace  text    NOT NULL,
    kb_ref     text    NOT NULL,
    generation integer NOT NULL,
    lexeme     text    NOT NULL,
    chunks     bigint  NOT NULL,  -- the chunks holding it (its document frequency)
    PRIMARY KEY (namespace, kb_ref, generation, lexeme),
    FOREIGN KEY (namespace, kb_ref, generation) REFERENCES tokensvc.text_statistics ON DELETE CASCADE
);

ALTER TABLE tokensvc.text_statistics ENABLE ROW LEVEL SECURITY;
ALTER TABLE tokensvc.text_statistics FORCE ROW LEVEL SECURITY;
CREATE POLICY text_statistics_tenant ON tokensvc.text_statistics
    USING (tokensvc.kb_visible(namespace, kb_ref)) WITH CHECK (tokensvc.kb_visible(namespace, kb_ref));
ALTER TABLE tokensvc.common_lexemes ENABLE ROW LEVEL SECURITY;
ALTER TABLE tokensvc.common_lexemes FORCE ROW LEVEL SECURITY;
CREATE POLICY common_lexemes_tenant ON tokensvc.common_lexemes
    USING (tokensvc.kb_visible(namespace, kb_ref)) WITH CHECK (tokensvc.kb_visible(namespace, kb_ref));

REVOKE ALL ON tokensvc.text_statistics, tokensvc.common_lexemes FROM {app_role};
GRANT SELECT ON tokensvc.text_statistics, tokensvc.common_lexemes TO {app_role};
