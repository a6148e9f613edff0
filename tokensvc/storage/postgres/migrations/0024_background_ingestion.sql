-- Background ingestion (issue 37): an upload is stored durably and queued; any replica's runner
-- extracts, chunks and embeds it batch by batch, and the version becomes searchable in one step.
--
-- `ingestions`: at most one version per document on its way in (a newer upload replaces it);
-- it ends when the version is the document's row (READY), or stays FAILED with its reason until
-- a newer upload or a deletion. Its lease fences every write of the runner working on it.
-- `ingestion_content`: the uploaded bytes, and once extracted the text and source spans.
-- `ingestion_chunks`: the chunks cut from that text, each with its vector once embedded; `finish`
-- moves them into `chunks` in the transaction that swaps the version (functions/ingestion.sql).
--
-- All three are keyed by namespace first and co-located with the knowledge bases on Citus (a
-- version's move stays on one node); a base's deletion cascades to them. Row-level security as
-- on every tenant table.

CREATE TABLE tokensvc.ingestions (
    namespace      text        NOT NULL,
    id             uuid        NOT NULL,
    kb_ref         text        NOT NULL,
    doc_ref        text        NOT NULL,
    version        bigint      NOT NULL CHECK (version >= 1),
    content_type   text        NOT NULL,
    content_sha256 bytea       NOT NULL,
    size_bytes     bigint      NOT NULL,
    metadata       jsonb       NOT NULL DEFAULT '{}'::jsonb,
    state          text        NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'processing', 'failed')),
    -- The base generation the staged chunks were cut and embedded for (NULL: not extracted), and
    -- the base's backfilling re-embedding migration whose target chunks are staged too (NULL:
    -- none), so the finished version is migrated already and the migration can cut over while
    -- uploads go on.
    generation     integer,
    migration      uuid,
    chunks_total   integer     CHECK (chunks_total >= 0),
    chunks_done    integer     NOT NULL DEFAULT 0 CHECK (chunks_done >= 0),
    reason         text        NOT NULL DEFAULT '',
    failures       integer     NOT NULL DEFAULT 0,
    lease_owner    text,
    lease_until    timestamptz,
    created_at     timestamptz NOT NULL DEFAULT statement_timestamp(),
    updated_at     timestamptz NOT NULL DEFAULT statement_timestamp(),
    PRIMARY KEY (namespace, id),
    UNIQUE (namespace, kb_ref, doc_ref),
    FOREIGN KEY (namespace, kb_ref) REFERENCES tokensvc.knowledge_bases ON DELETE CASCADE
);
-- The claim's scan: the unfinished ones, oldest first.
CREATE INDEX ingestions_queue ON tokensvc.ingestions (created_at) WHERE state <> 'failed';

CREATE TABLE tokensvc.ingestion_content (
    namespace    text  NOT NULL,
    ingestion    uuid  NOT NULL,
    kb_ref       text  NOT NULL,
    content      bytea NOT NULL,
    -- Set by the extraction: the text the chunks index, its source spans, the recognised type.
    text         text,
    source_spans jsonb,
    media_type   text,
    PRIMARY KEY (namespace, ingestion),
    FOREIGN KEY (namespace, ingestion) REFERENCES tokensvc.ingestions ON DELETE CASCADE
);

CREATE TABLE tokensvc.ingestion_chunks (
    namespace    text    NOT NULL,
    ingestion    uuid    NOT NULL,
    kb_ref       text    NOT NULL,
    -- A chunk for the migration's target (the base's next generation), or for the base as it is.
    target       boolean NOT NULL DEFAULT false,
    chunk_index  integer NOT NULL,
    text         text    NOT NULL,
    start_offset integer NOT NULL,
    end_offset   integer NOT NULL,
    heading_path text[]  NOT NULL DEFAULT '{}',
    location     jsonb,
    dimension    integer,
    embedding    vector,
    PRIMARY KEY (namespace, ingestion, target, chunk_index),
    FOREIGN KEY (namespace, ingestion) REFERENCES tokensvc.ingestions ON DELETE CASCADE,
    CHECK ((embedding IS NULL) = (dimension IS NULL)),
    CHECK (embedding IS NULL OR vector_dims(embedding) = dimension)
);

ALTER TABLE tokensvc.ingestions ENABLE ROW LEVEL SECURITY;
ALTER TABLE tokensvc.ingestions FORCE ROW LEVEL SECURITY;
CREATE POLICY ingestions_tenant ON tokensvc.ingestions
    USING (tokensvc.kb_visible(namespace, kb_ref)) WITH CHECK (tokensvc.kb_visible(namespace, kb_ref));
-- The queue is every tenant's: the owner's functions claim from it and count it across
-- namespaces (functions/ingestion.sql), as the owner's sweep and statistics do for memories.
DO $$
BEGIN
    EXECUTE format('CREATE POLICY ingestions_owner_queue ON tokensvc.ingestions FOR SELECT TO %I '
                   'USING (true)', current_user);
    EXECUTE format('CREATE POLICY ingestions_owner_claim ON tokensvc.ingestions FOR UPDATE TO %I '
                   'USING (true) WITH CHECK (true)', current_user);
END $$;
ALTER TABLE tokensvc.ingestion_content ENABLE ROW LEVEL SECURITY;
ALTER TABLE tokensvc.ingestion_content FORCE ROW LEVEL SECURITY;
CREATE POLICY ingestion_content_tenant ON tokensvc.ingestion_content
    USING (tokensvc.kb_visible(namespace, kb_ref)) WITH CHECK (tokensvc.kb_visible(namespace, kb_ref));
ALTER TABLE tokensvc.ingestion_chunks ENABLE ROW LEVEL SECURITY;
ALTER TABLE tokensvc.ingestion_chunks FORCE ROW LEVEL SECURITY;
CREATE POLICY ingestion_chunks_tenant ON tokensvc.ingestion_chunks
    USING (tokensvc.kb_visible(namespace, kb_ref)) WITH CHECK (tokensvc.kb_visible(namespace, kb_ref));

-- The serving role reads an upload's state and deletes it (a newer upload, a deletion); it queues
-- one and replaces its metadata through the owner's functions, so it never writes a lease, a
-- state, progress or a staged chunk, and never reads the bytes back. The runner role (its own
-- credential, 0021) reaches these tables only through the owner's functions, which check its
-- lease (functions/ingestion.sql).
REVOKE ALL ON tokensvc.ingestions, tokensvc.ingestion_content, tokensvc.ingestion_chunks FROM {app_role};
GRANT SELECT, DELETE ON tokensvc.ingestions TO {app_role};
