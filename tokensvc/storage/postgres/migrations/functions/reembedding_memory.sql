-- Re-embedding a memory space: the guard that keeps writes on the space's current generation,
-- the backfill's batches, the clean-up of the old vectors and the cutover.
--
-- Applied after the numbered migrations whenever this file changes (docs/development.md,
-- "Changing a SQL function"): each definition is the current one, in place.


-- A memory is written for its space's generation, and during a migration into both slots (the
-- target's too). The guard reads the migration row without locking it (a cancel is ordered with
-- the write by the space row instead); the cutover locks the space row before the migration's.
CREATE OR REPLACE FUNCTION tokensvc.memories_generation_guard() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    declared text := current_setting('tokensvc.generation', true);
    dual_write text := current_setting('tokensvc.dual_write', true);
    current_generation integer;
    backfilling uuid;
    other_written boolean;
    other_present boolean;
    keep boolean := false;
BEGIN
    IF declared IS NULL OR declared = '' THEN
        RETURN NEW;  -- not a tenant write: a bucket move, the migration runner, the sweep
    END IF;
    SELECT s.generation INTO current_generation FROM tokensvc.memory_spaces s
    WHERE s.namespace = NEW.namespace AND s.agent = NEW.agent FOR SHARE;
    IF current_generation IS DISTINCT FROM declared::integer THEN
        RAISE EXCEPTION 'memory space %/% is at generation %, not %', NEW.namespace, NEW.agent,
            current_generation, declared USING ERRCODE = 'TK001';
    END IF;
    IF current_generation % 2 = 0 THEN
        other_written := TG_OP = 'INSERT' OR NEW.embedding_b IS DISTINCT FROM OLD.embedding_b;
        other_present := NEW.embedding_b IS NOT NULL;
    ELSE
        other_written := TG_OP = 'INSERT' OR NEW.embedding IS DISTINCT FROM OLD.embedding;
        other_present := NEW.embedding IS NOT NULL;
    END IF;
    IF other_written AND other_present THEN
        -- After the space row's share lock, in a statement of its own (a snapshot taken after
        -- it): a cancel holds the space row FOR UPDATE while it changes the migration, so this
        -- sees a cancel that committed before the lock, and a later cancel waits for this write.
        SELECT m.id INTO backfilling FROM tokensvc.embedding_migrations m
        WHERE m.namespace = NEW.namespace AND m.agent = NEW.agent AND m.state = 'backfilling';
        keep := backfilling IS NOT NULL AND backfilling::text = dual_write;
    END IF;
    IF (other_written AND NOT keep)
       OR (TG_OP = 'UPDATE' AND NEW.content IS DISTINCT FROM OLD.content AND NOT (other_written AND keep)) THEN
        IF current_generation % 2 = 0 THEN
            NEW.embedding_b := NULL;
            NEW.dimension_b := NULL;
        ELSE
            NEW.embedding := NULL;
            NEW.dimension := NULL;
        END IF;
    END IF;
    RETURN NEW;
END $$;
REVOKE ALL ON FUNCTION tokensvc.memories_generation_guard() FROM PUBLIC, {app_role}, {runner_role};

-- Created when missing, never replaced: on Citus a trigger's DDL on a placed table goes to the
-- workers only from inside a DO block. To change it, a numbered migration drops it (in a DO block)
-- and this file, applied after, creates it anew (docs/development.md).
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_trigger WHERE tgrelid = 'tokensvc.memories'::regclass
                   AND tgname = 'memories_generation_guard') THEN
        CREATE TRIGGER memories_generation_guard BEFORE INSERT OR UPDATE ON tokensvc.memories
            FOR EACH ROW EXECUTE FUNCTION tokensvc.memories_generation_guard();
    END IF;
END $$;

-- The next batch of a space's backfill, for a transaction that declared that space only: the
-- bucket ids it returns go to the runner of that space's migration, in that migration's
-- transaction.
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
    IF m.agent IS NULL OR m.namespace IS DISTINCT FROM current_setting('tokensvc.namespace', true)
       OR m.agent IS DISTINCT FROM current_setting('tokensvc.agent', true) THEN
        RAISE EXCEPTION 'a backfill reads the memory space its transaction declared' USING ERRCODE = '42501';
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
REVOKE ALL ON FUNCTION tokensvc.migration_pending(uuid,text,text,uuid,integer) FROM PUBLIC, {app_role};
GRANT EXECUTE ON FUNCTION tokensvc.migration_pending(uuid,text,text,uuid,integer) TO {runner_role};

-- A batch's new vectors, each into the target's slot of a memory still as it was read (same
-- content hash): a memory changed since is left for the next pass. Returns how many were written.
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
REVOKE ALL ON FUNCTION tokensvc.migration_store(uuid,text,text[],uuid[],bytea[],vector[]) FROM PUBLIC, {app_role};
GRANT EXECUTE ON FUNCTION tokensvc.migration_store(uuid,text,text[],uuid[],bytea[],vector[]) TO {runner_role};

-- A memory space's clean-up batch (after a cutover or a cancel) takes its locks after its
-- multi-shard statement, not before. On Citus a row lock of a reference table is a lock of the
-- whole table: held through a read and UPDATE over every shard (6 to 13 s each under the Citus
-- suite's load), the space row FOR SHARE queued the pin of any new space and, behind it, every
-- tenant's write, and the migration row FOR UPDATE held up every runner's claim and renewal.
--
-- So: the lease is checked as it is, without a lock; the batch is emptied; then the space row
-- FOR SHARE and the migration row FOR UPDATE are taken (lock_migration_subject's order) and the
-- lease, state and generation checked again. A runner that lost its lease meanwhile raises TK002 there, and its
-- UPDATE rolls back with it: a slot another runner (or a later migration) fills is never emptied.
-- The emptied slot is one no tenant write fills (the old generation's after a cutover: the
-- generation guard refuses such writes; the target's after a cancel: dual writes have stopped), so
-- nothing written between the read and the locks is missed.


CREATE OR REPLACE FUNCTION tokensvc.migration_clear(migration uuid, runner text, lim integer, lease_seconds float8)
RETURNS integer LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    m tokensvc.embedding_migrations;
    locked tokensvc.embedding_migrations;
    slot integer;
    held integer;
    last_bucket text;
    last_id uuid;
BEGIN
    SELECT * INTO m FROM tokensvc.embedding_migrations WHERE id = migration;
    IF NOT FOUND OR m.state NOT IN ('retiring', 'cancelling') OR m.agent IS NULL OR runner IS NULL
       OR m.lease_owner IS DISTINCT FROM runner OR m.lease_until IS NULL
       OR m.lease_until < clock_timestamp() THEN
        RAISE EXCEPTION 'migration % is not leased to this runner in state {retiring,cancelling}', migration
            USING ERRCODE = 'TK002';
    END IF;
    IF lim IS NULL OR lim < 1 OR lim > 10000 THEN
        RAISE EXCEPTION 'a batch of 1 to 10000 memories';
    END IF;
    slot := CASE WHEN m.state = 'retiring' THEN m.from_generation % 2 ELSE (m.from_generation + 1) % 2 END;
    EXECUTE format(
        'WITH batch AS (SELECT bucket, id FROM tokensvc.memories WHERE namespace = $1 AND agent = $2 '
        '  AND %1$I IS NOT NULL AND ($3::text IS NULL OR (bucket, id) > ($3, $4)) '
        '  ORDER BY bucket, id LIMIT $5), '
        'done AS (UPDATE tokensvc.memories x SET %2$I = NULL, %1$I = NULL FROM batch '
        '  WHERE x.bucket = batch.bucket AND x.id = batch.id) '
        'SELECT (SELECT count(*)::integer FROM batch), b.bucket, b.id FROM (SELECT 1) AS one '
        'LEFT JOIN (SELECT bucket, id FROM batch ORDER BY bucket DESC, id DESC LIMIT 1) AS b ON true',
        CASE WHEN slot = 0 THEN 'dimension' ELSE 'dimension_b' END,
        CASE WHEN slot = 0 THEN 'embedding' ELSE 'embedding_b' END)
    INTO held, last_bucket, last_id
    USING m.namespace, m.agent, m.cursor_bucket, m.cursor_id, lim;
    PERFORM tokensvc.lock_migration_subject(migration, false);
    locked := tokensvc.leased_migration(migration, runner, ARRAY[m.state]);
    IF locked.from_generation IS DISTINCT FROM m.from_generation THEN
        RAISE EXCEPTION 'migration % changed while its batch was emptied', migration USING ERRCODE = 'TK002';
    END IF;
    UPDATE tokensvc.embedding_migrations
    SET cursor_bucket = coalesce(last_bucket, cursor_bucket), cursor_id = coalesce(last_id, cursor_id),
        lease_until = statement_timestamp() + make_interval(secs => lease_seconds),
        updated_at = statement_timestamp()
    WHERE id = migration;
    RETURN held;
END $$;
REVOKE ALL ON FUNCTION tokensvc.migration_clear(uuid,text,integer,double precision) FROM PUBLIC, {app_role};
GRANT EXECUTE ON FUNCTION tokensvc.migration_clear(uuid,text,integer,double precision) TO {runner_role};

-- A memory space's cutover to the migration's generation, for the runner holding the lease.
CREATE OR REPLACE FUNCTION tokensvc.cut_over_memory_space(migration uuid, runner text) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    m tokensvc.embedding_migrations;
    current_generation integer;
BEGIN
    IF NOT tokensvc.lock_migration_subject(migration, true) THEN
        RETURN false;
    END IF;
    SELECT * INTO m FROM tokensvc.embedding_migrations WHERE id = migration FOR UPDATE;
    IF m.agent IS NULL OR m.state <> 'backfilling' OR runner IS NULL OR m.lease_owner IS DISTINCT FROM runner
       OR m.lease_until IS NULL OR m.lease_until < clock_timestamp() THEN
        RETURN false;
    END IF;
    SELECT generation INTO current_generation FROM tokensvc.memory_spaces
    WHERE namespace = m.namespace AND agent = m.agent;
    IF current_generation IS DISTINCT FROM m.from_generation THEN
        RAISE EXCEPTION 'memory space %/% is at generation %, the migration started from %',
            m.namespace, m.agent, current_generation, m.from_generation;
    END IF;
    IF EXISTS (
        SELECT 1 FROM tokensvc.memories
        WHERE namespace = m.namespace AND agent = m.agent AND (expires_at IS NULL OR expires_at > now())
          AND CASE WHEN m.from_generation % 2 = 0 THEN dimension_b IS DISTINCT FROM m.to_dimension
                   ELSE dimension IS DISTINCT FROM m.to_dimension END
    ) THEN
        RETURN false;
    END IF;
    UPDATE tokensvc.memory_spaces
    SET embedder = m.to_embedder, model = m.to_model, dimension = m.to_dimension,
        normalized = m.to_normalized, generation = m.from_generation + 1
    WHERE namespace = m.namespace AND agent = m.agent;
    UPDATE tokensvc.embedding_migrations
    SET state = 'retiring', cut_over_at = statement_timestamp(), updated_at = statement_timestamp(),
        cursor_bucket = NULL, cursor_id = NULL
    WHERE id = migration;
    INSERT INTO tokensvc.audit_events (kind, actor, action, target, outcome, detail)
    VALUES ('embedding_migration', 'system:tokensvc', 'cut over embedding migration',
            format('migration:%s space:%s/%s', m.id, m.namespace, m.agent), 'succeeded',
            format('the space now reads %s (%s)', m.to_embedder, m.to_dimension));
    RETURN true;
END $$;
REVOKE ALL ON FUNCTION tokensvc.cut_over_memory_space(uuid,text) FROM PUBLIC, {app_role};
GRANT EXECUTE ON FUNCTION tokensvc.cut_over_memory_space(uuid,text) TO {runner_role};
