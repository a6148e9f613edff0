-- A memory space's backfill without multi-shard statements under the migration's row lock
-- (issue 19). On Citus a row lock of a reference table is a lock of the whole table (a FOR UPDATE
-- an exclusive lock of its one shard), and a space's batch spans buckets on many shards:
--
-- * migration_pending read the migration row FOR UPDATE (leased_migration), then ran its read
--   over every shard (seconds), so every runner's claim and renewal and every dual write's guard
--   (the migration row FOR SHARE) waited for it. A read needs the lease, not a lock: it checks it
--   as it is now, and the batch's write checks it again under its lock (hold_migration).
-- * migration_store updated the batch in one statement joined with its arrays, which Citus runs
--   on every shard (seconds, under that lock). It now updates each memory by its bucket and id:
--   one router statement per memory, to one shard's one partition (one index probe on one node).
--
-- Replaced in place, with the same signatures (grants are kept, older replicas unaffected).

CREATE OR REPLACE FUNCTION tokensvc.migration_pending(migration uuid, runner text, after_bucket text,
                                                      after_id uuid, lim integer)
RETURNS TABLE (bucket text, id uuid, content text, content_sha256 bytea)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    m tokensvc.embedding_migrations;
    slot integer;
BEGIN
    SELECT * INTO m FROM tokensvc.embedding_migrations WHERE embedding_migrations.id = migration;
    IF NOT FOUND OR m.state <> 'backfilling' OR runner IS NULL OR m.lease_owner IS DISTINCT FROM runner
       OR m.lease_until IS NULL OR m.lease_until < clock_timestamp() THEN
        RAISE EXCEPTION 'migration % is not leased to this runner in state {backfilling}', migration
            USING ERRCODE = 'TK002';
    END IF;
    IF lim IS NULL OR lim < 1 OR lim > 10000 OR (after_bucket IS NULL) <> (after_id IS NULL) THEN
        RAISE EXCEPTION 'a batch of 1 to 10000 memories after a whole cursor';
    END IF;
    slot := (m.from_generation + 1) % 2;
    RETURN QUERY
    SELECT x.bucket, x.id, x.content, x.content_sha256 FROM tokensvc.memories x
    WHERE x.namespace = m.namespace AND x.agent = m.agent AND (x.expires_at IS NULL OR x.expires_at > now())
      AND CASE WHEN slot = 0 THEN x.dimension ELSE x.dimension_b END IS DISTINCT FROM m.to_dimension
      AND (after_bucket IS NULL OR (x.bucket, x.id) > (after_bucket, after_id))
    ORDER BY x.bucket, x.id LIMIT lim;
END $$;

CREATE OR REPLACE FUNCTION tokensvc.migration_store(migration uuid, runner text, buckets text[], ids uuid[],
                                                    hashes bytea[], vectors vector[])
RETURNS integer LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    m tokensvc.embedding_migrations := tokensvc.leased_migration(migration, runner, ARRAY['backfilling']);
    written integer := 0;
    one integer;
BEGIN
    IF cardinality(buckets) IS DISTINCT FROM cardinality(ids) OR cardinality(ids) IS DISTINCT FROM cardinality(hashes)
       OR cardinality(hashes) IS DISTINCT FROM cardinality(vectors) THEN
        RAISE EXCEPTION 'a batch''s buckets, ids, hashes and vectors differ in number';
    END IF;
    IF EXISTS (SELECT 1 FROM unnest(vectors) v WHERE vector_dims(v) <> m.to_dimension) THEN
        RAISE EXCEPTION 'a vector is not of the migration''s dimension %', m.to_dimension;
    END IF;
    -- EXECUTE: a plan per memory with its values bound, which Citus routes to the memory's
    -- shard (a cached PL/pgSQL plan of the same UPDATE crashed the coordinator, Citus 15.0devel).
    FOR k IN 1 .. coalesce(cardinality(ids), 0) LOOP
        EXECUTE format(
            'UPDATE tokensvc.memories x SET %I = $1, %I = $2 WHERE x.bucket = $3 AND x.id = $4 '
            'AND x.content_sha256 = $5 AND x.namespace = $6 AND x.agent = $7',
            CASE WHEN (m.from_generation + 1) % 2 = 0 THEN 'embedding' ELSE 'embedding_b' END,
            CASE WHEN (m.from_generation + 1) % 2 = 0 THEN 'dimension' ELSE 'dimension_b' END)
        USING vectors[k], m.to_dimension, buckets[k], ids[k], hashes[k], m.namespace, m.agent;
        GET DIAGNOSTICS one = ROW_COUNT;
        written := written + one;
    END LOOP;
    RETURN written;
END $$;
