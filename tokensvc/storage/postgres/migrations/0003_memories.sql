-- Long-term memory. Every row is keyed by its tenant bucket first (Citus can distribute by it),
-- and row-level security is the second wall behind the bucket predicate every query carries.

-- A memory space is one agent's memory (namespace + agent); its embedder is pinned at first write.
CREATE TABLE tokensvc.memory_spaces (
    namespace  text        NOT NULL,
    agent      text        NOT NULL,
    embedder   text        NOT NULL,
    model      text        NOT NULL,
    dimension  integer     NOT NULL CHECK (dimension BETWEEN 1 AND 16000),
    normalized boolean     NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (namespace, agent)
);

CREATE TABLE tokensvc.memories (
    bucket          text        NOT NULL,
    id              uuid        NOT NULL,
    namespace       text        NOT NULL,
    agent           text        NOT NULL,
    content         text        NOT NULL,
    -- SHA-256 of the normalised content: the same fact in the same bucket is stored once.
    content_sha256  bytea       NOT NULL,
    metadata        jsonb       NOT NULL DEFAULT '{}'::jsonb,
    idempotency_key text,
    dimension       integer     NOT NULL,
    -- Unit length always (normalised on write), so inner product is cosine similarity.
    embedding       vector      NOT NULL,
    content_tsv     tsvector    GENERATED ALWAYS AS (to_tsvector('simple', content)) STORED,
    created_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    expires_at      timestamptz,
    PRIMARY KEY (bucket, id),
    UNIQUE (bucket, content_sha256),
    CHECK (vector_dims(embedding) = dimension)
);
CREATE UNIQUE INDEX memories_idempotency ON tokensvc.memories (bucket, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX memories_newest ON tokensvc.memories (bucket, created_at DESC, id DESC);
CREATE INDEX memories_text ON tokensvc.memories USING gin (content_tsv);
CREATE INDEX memories_expiry ON tokensvc.memories (expires_at) WHERE expires_at IS NOT NULL;

-- HNSW indexes are per dimension (an expression index needs a typed vector): the default
-- embedder's here, any other when a space pins it (ensure_memory_vector_index).
CREATE INDEX memories_hnsw_384 ON tokensvc.memories
    USING hnsw ((embedding::vector(384)) vector_ip_ops) WITH (m = 16, ef_construction = 64)
    WHERE dimension = 384;

-- Row-level security: a transaction sees only the buckets (and the space) it declared with
-- set_config(..., true). FORCE applies it to the owner too.
ALTER TABLE tokensvc.memories ENABLE ROW LEVEL SECURITY;
ALTER TABLE tokensvc.memories FORCE ROW LEVEL SECURITY;
CREATE POLICY memories_tenant ON tokensvc.memories
    USING (bucket = ANY (string_to_array(current_setting('tokensvc.buckets', true), ',')))
    WITH CHECK (bucket = ANY (string_to_array(current_setting('tokensvc.buckets', true), ',')));
-- The sweeper deletes expired rows of every bucket; expired rows are never returned anyway.
CREATE POLICY memories_sweep ON tokensvc.memories FOR DELETE
    USING (expires_at IS NOT NULL AND expires_at <= now());
-- A DELETE whose WHERE reads a column must also pass a SELECT policy, so without this one the
-- sweeper (no tenant) finds nothing to delete. It sees expired rows only, and only in a
-- transaction that declared itself a sweep with set_config('tokensvc.sweep', 'on', true).
CREATE POLICY memories_sweep_read ON tokensvc.memories FOR SELECT
    USING (current_setting('tokensvc.sweep', true) = 'on'
           AND expires_at IS NOT NULL AND expires_at <= now());

ALTER TABLE tokensvc.memory_spaces ENABLE ROW LEVEL SECURITY;
ALTER TABLE tokensvc.memory_spaces FORCE ROW LEVEL SECURITY;
CREATE POLICY memory_spaces_tenant ON tokensvc.memory_spaces
    USING (namespace = current_setting('tokensvc.namespace', true)
           AND agent = current_setting('tokensvc.agent', true))
    WITH CHECK (namespace = current_setting('tokensvc.namespace', true)
                AND agent = current_setting('tokensvc.agent', true));
-- A pinned embedder is never silently re-pinned.
REVOKE UPDATE ON tokensvc.memory_spaces FROM {app_role};
