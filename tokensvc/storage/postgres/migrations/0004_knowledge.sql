-- Knowledge bases: managed corpora of versioned documents, chunked and embedded. Rows are keyed
-- by namespace first. Row-level security binds a transaction to one namespace and to the
-- knowledge bases it declared (`tokensvc.kbs`: a comma-separated roster, or '*' for management).

CREATE TABLE tokensvc.knowledge_bases (
    namespace     text        NOT NULL,
    ref           text        NOT NULL,
    display_name  text        NOT NULL DEFAULT '',
    embedder      text        NOT NULL,
    model         text        NOT NULL,
    dimension     integer     NOT NULL CHECK (dimension BETWEEN 1 AND 16000),
    normalized    boolean     NOT NULL,
    chunking      text        NOT NULL CHECK (chunking IN ('fixed', 'recursive', 'markdown')),
    chunk_size    integer     NOT NULL,
    chunk_overlap integer     NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (namespace, ref)
);

CREATE TABLE tokensvc.documents (
    namespace      text        NOT NULL,
    kb_ref         text        NOT NULL,
    ref            text        NOT NULL,
    version        bigint      NOT NULL CHECK (version >= 1),
    content_type   text        NOT NULL,
    content_sha256 bytea       NOT NULL,
    size_bytes     bigint      NOT NULL,
    chunk_count    integer     NOT NULL,
    metadata       jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (namespace, kb_ref, ref),
    FOREIGN KEY (namespace, kb_ref) REFERENCES tokensvc.knowledge_bases ON DELETE CASCADE
);

-- Only the current version's chunks exist in any snapshot: a new version's chunks are inserted
-- and the old ones deleted in the same transaction, so one statement never sees a mix.
CREATE TABLE tokensvc.chunks (
    namespace    text     NOT NULL,
    kb_ref       text     NOT NULL,
    doc_ref      text     NOT NULL,
    version      bigint   NOT NULL,
    chunk_index  integer  NOT NULL,
    text         text     NOT NULL,
    start_offset integer  NOT NULL,
    end_offset   integer  NOT NULL,
    heading_path text[]   NOT NULL DEFAULT '{}',
    -- The document's metadata, copied so filtered searches need no join.
    metadata     jsonb    NOT NULL DEFAULT '{}'::jsonb,
    dimension    integer  NOT NULL,
    embedding    vector   NOT NULL,
    content_tsv  tsvector GENERATED ALWAYS AS (to_tsvector('simple', text)) STORED,
    PRIMARY KEY (namespace, kb_ref, doc_ref, version, chunk_index),
    FOREIGN KEY (namespace, kb_ref, doc_ref) REFERENCES tokensvc.documents ON DELETE CASCADE,
    CHECK (vector_dims(embedding) = dimension)
);
CREATE INDEX chunks_text ON tokensvc.chunks USING gin (content_tsv);
CREATE INDEX chunks_kb ON tokensvc.chunks (namespace, kb_ref);

-- HNSW per dimension, as for memories: the default embedder's here, others when a base pins them.
CREATE INDEX chunks_hnsw_384 ON tokensvc.chunks
    USING hnsw ((embedding::vector(384)) vector_ip_ops) WITH (m = 16, ef_construction = 64)
    WHERE dimension = 384;

CREATE FUNCTION tokensvc.kb_visible(ns text, kb text) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT ns = current_setting('tokensvc.namespace', true)
       AND (current_setting('tokensvc.kbs', true) = '*'
            OR kb = ANY (string_to_array(current_setting('tokensvc.kbs', true), ',')))
$$;

ALTER TABLE tokensvc.knowledge_bases ENABLE ROW LEVEL SECURITY;
ALTER TABLE tokensvc.knowledge_bases FORCE ROW LEVEL SECURITY;
CREATE POLICY knowledge_bases_tenant ON tokensvc.knowledge_bases
    USING (tokensvc.kb_visible(namespace, ref)) WITH CHECK (tokensvc.kb_visible(namespace, ref));
ALTER TABLE tokensvc.documents ENABLE ROW LEVEL SECURITY;
ALTER TABLE tokensvc.documents FORCE ROW LEVEL SECURITY;
CREATE POLICY documents_tenant ON tokensvc.documents
    USING (tokensvc.kb_visible(namespace, kb_ref)) WITH CHECK (tokensvc.kb_visible(namespace, kb_ref));
ALTER TABLE tokensvc.chunks ENABLE ROW LEVEL SECURITY;
ALTER TABLE tokensvc.chunks FORCE ROW LEVEL SECURITY;
CREATE POLICY chunks_tenant ON tokensvc.chunks
    USING (tokensvc.kb_visible(namespace, kb_ref)) WITH CHECK (tokensvc.kb_visible(namespace, kb_ref));
-- Pinned choices are never changed in place.
REVOKE UPDATE ON tokensvc.knowledge_bases FROM {app_role};
