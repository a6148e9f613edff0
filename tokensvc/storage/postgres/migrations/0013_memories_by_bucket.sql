-- Memories are hash-partitioned by bucket, 256 partitions, each with its own indexes (issue 15).
-- A search names its bucket, so it reads one partition and that partition's HNSW graph: its cost
-- grows with the buckets that share the partition (a 256th of the table), not with the table, as
-- it did with one graph over every tenant (measured in docs/benchmarks.md, "Cost growth").
--
-- Every guarantee stays: the columns, constraints and indexes are the same (every unique key
-- starts with the bucket, so each is enforced per partition, exactly), row-level security is on
-- the table every query names and forced on every partition, which has no policy and no grant, so
-- it cannot be read or written except through `memories`; a pepper rotation's bucket move is a
-- cross-partition UPDATE. Rows are copied in this migration's transaction: all or nothing. Writers
-- wait for it throughout; readers only for the swap at the end.
--
-- Partition p holds the buckets with hash(bucket) mod 256 = p; the HNSW index of dimension D on
-- partition p is memories_pNNN_hnsw_D (so plans name the partition they read), attached to the
-- partitioned index memories_hnsw_D.

-- No write may commit between the copy and the DROP, or it would be lost with the old table (or
-- a deleted row come back): writers wait from here to the commit; readers go on until the DROP.
LOCK TABLE tokensvc.memories IN SHARE ROW EXCLUSIVE MODE;

CREATE TABLE tokensvc.memories_by_bucket (
    LIKE tokensvc.memories INCLUDING DEFAULTS INCLUDING GENERATED INCLUDING CONSTRAINTS
) PARTITION BY HASH (bucket);

DO $$
BEGIN
    FOR p IN 0..255 LOOP
        EXECUTE format(
            'CREATE TABLE tokensvc.memories_p%s PARTITION OF tokensvc.memories_by_bucket '
            'FOR VALUES WITH (MODULUS 256, REMAINDER %s)', lpad(p::text, 3, '0'), p);
    END LOOP;
END $$;

-- The owner reads every row through its statistics policy (0006); `tokensvc migrate` always runs
-- as the owner.
INSERT INTO tokensvc.memories_by_bucket (bucket, id, namespace, agent, content, content_sha256,
                                         metadata, idempotency_key, dimension, embedding,
                                         created_at, updated_at, expires_at, text_config)
SELECT bucket, id, namespace, agent, content, content_sha256, metadata, idempotency_key, dimension,
       embedding, created_at, updated_at, expires_at, text_config
FROM tokensvc.memories;

-- Everything is built on the new table before the old one is dropped: until then readers go on
-- (only writers wait for the lock above), so reads stop only for the renames and policies below.
-- Index names carry a memories_by_bucket_ prefix while the old table's names are taken.
ALTER TABLE tokensvc.memories_by_bucket ADD CONSTRAINT memories_by_bucket_pkey PRIMARY KEY (bucket, id);
ALTER TABLE tokensvc.memories_by_bucket
    ADD CONSTRAINT memories_by_bucket_content_sha256_key UNIQUE (bucket, content_sha256);
CREATE UNIQUE INDEX memories_by_bucket_idempotency ON tokensvc.memories_by_bucket (bucket, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX memories_by_bucket_newest ON tokensvc.memories_by_bucket (bucket, created_at DESC, id DESC);
CREATE INDEX memories_by_bucket_text ON tokensvc.memories_by_bucket USING gin (content_tsv);
CREATE INDEX memories_by_bucket_expiry ON tokensvc.memories_by_bucket (expires_at)
    WHERE expires_at IS NOT NULL;

-- HNSW for every dimension the old table had an index for (every dimension a space has pinned;
-- 384 always), read from the catalogue: memory_spaces' rows are hidden from the owner by its
-- row-level security.
-- One graph per partition, pNNN_hnsw_D, attached to the partitioned index
-- memories_by_bucket_hnsw_D (build_memory_vector_index does the same for a dimension pinned later).
DO $$
DECLARE
    dim integer;
    part record;
BEGIN
    FOR dim IN
        SELECT indexed.dimension
        FROM (SELECT substring(indexname FROM '^memories_hnsw_(\d+)$')::integer AS dimension
              FROM pg_indexes WHERE schemaname = 'tokensvc' AND indexname ~ '^memories_hnsw_\d+$'
              UNION SELECT 384) AS indexed
        ORDER BY indexed.dimension
    LOOP
        EXECUTE format(
            'CREATE INDEX %I ON ONLY tokensvc.memories_by_bucket '
            'USING hnsw ((embedding::vector(%s)) vector_ip_ops) WITH (m = 16, ef_construction = 64) '
            'WHERE dimension = %s', 'memories_by_bucket_hnsw_' || dim, dim, dim);
        FOR part IN
            SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
            WHERE i.inhparent = 'tokensvc.memories_by_bucket'::regclass ORDER BY c.relname
        LOOP
            EXECUTE format(
                'CREATE INDEX %I ON tokensvc.%I '
                'USING hnsw ((embedding::vector(%s)) vector_ip_ops) WITH (m = 16, ef_construction = 64) '
                'WHERE dimension = %s', part.relname || '_hnsw_' || dim, part.relname, dim, dim);
            EXECUTE format('ALTER INDEX tokensvc.%I ATTACH PARTITION tokensvc.%I',
                           'memories_by_bucket_hnsw_' || dim, part.relname || '_hnsw_' || dim);
        END LOOP;
    END LOOP;
END $$;
-- Fresh statistics for the new partitions (autovacuum would take a while to get to 256 of them).
ANALYZE tokensvc.memories_by_bucket;

-- The swap: from here to the commit, readers wait too (seconds).
DROP TABLE tokensvc.memories;
ALTER TABLE tokensvc.memories_by_bucket RENAME TO memories;
ALTER TABLE tokensvc.memories RENAME CONSTRAINT memories_by_bucket_pkey TO memories_pkey;
ALTER TABLE tokensvc.memories
    RENAME CONSTRAINT memories_by_bucket_content_sha256_key TO memories_bucket_content_sha256_key;
DO $$
DECLARE
    idx record;
BEGIN
    FOR idx IN
        SELECT c.relname FROM pg_class c
        WHERE c.relnamespace = 'tokensvc'::regnamespace AND c.relkind = 'I'
          AND c.relname LIKE 'memories\_by\_bucket\_%'
    LOOP
        EXECUTE format('ALTER INDEX tokensvc.%I RENAME TO %I', idx.relname,
                       'memories_' || substring(idx.relname FROM length('memories_by_bucket_') + 1));
    END LOOP;
END $$;

-- Row-level security as 0003, 0006 and 0008 set it, on the table every statement names.
ALTER TABLE tokensvc.memories ENABLE ROW LEVEL SECURITY;
ALTER TABLE tokensvc.memories FORCE ROW LEVEL SECURITY;
CREATE POLICY memories_tenant ON tokensvc.memories
    USING (bucket = ANY (string_to_array(current_setting('tokensvc.buckets', true), ',')))
    WITH CHECK (bucket = ANY (string_to_array(current_setting('tokensvc.buckets', true), ',')));
DO $$
BEGIN
    EXECUTE format('CREATE POLICY memories_owner_statistics ON tokensvc.memories FOR SELECT TO %I '
                   'USING (true)', current_user);
    EXECUTE format('CREATE POLICY memories_owner_sweep ON tokensvc.memories FOR DELETE TO %I '
                   'USING (expires_at IS NOT NULL AND expires_at <= now())', current_user);
END $$;
-- A partition is reached only through `memories`: no grant, and forced row-level security with no
-- policy, which refuses every row even to the owner.
DO $$
DECLARE
    part record;
BEGIN
    FOR part IN
        SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
        WHERE i.inhparent = 'tokensvc.memories'::regclass
    LOOP
        EXECUTE format('REVOKE ALL ON tokensvc.%I FROM {app_role}', part.relname);
        EXECUTE format('ALTER TABLE tokensvc.%I ENABLE ROW LEVEL SECURITY', part.relname);
        EXECUTE format('ALTER TABLE tokensvc.%I FORCE ROW LEVEL SECURITY', part.relname);
    END LOOP;
END $$;
