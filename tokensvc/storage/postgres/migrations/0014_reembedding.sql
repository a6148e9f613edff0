-- Re-embedding migrations (issue 16): a memory space moves to another embedder while it serves.
--
-- Every memory has two vector slots: (embedding, dimension) and (embedding_b, dimension_b). A
-- memory space reads and writes the slot of its generation (even: the first, odd: the second).
-- A migration fills the other slot in the background with the target embedder's vectors, then
-- cuts over by pinning the target and bumping the generation: one row, one atomic switch. The old
-- slot is emptied afterwards. Searches always read one slot, so no search mixes generations.
--
-- Adding nullable columns and dropping NOT NULL change the catalogue only; the new CHECK reads
-- every row once (all NULL: fast), under the lock ALTER TABLE takes.

ALTER TABLE tokensvc.memories
    ALTER COLUMN embedding DROP NOT NULL,
    ALTER COLUMN dimension DROP NOT NULL,
    ADD COLUMN dimension_b integer,
    ADD COLUMN embedding_b vector,
    -- A slot holds a vector and its dimension, or neither.
    ADD CONSTRAINT memories_slot_a CHECK ((embedding IS NULL) = (dimension IS NULL)),
    ADD CONSTRAINT memories_slot_b CHECK ((embedding_b IS NULL) = (dimension_b IS NULL)
                                          AND vector_dims(embedding_b) = dimension_b);

ALTER TABLE tokensvc.memory_spaces ADD COLUMN generation integer NOT NULL DEFAULT 0
    CHECK (generation >= 0);

-- HNSW for a (slot, dimension), one partition at a time: the serving role calls this for
-- partition 0, 1, ... each in a transaction of its own (it returns false past the last one), so a
-- build locks one partition's writes for that partition's build, never the whole table's. Names:
-- memories_pNNN_hnsw_D (first slot, as 0013 builds them) and memories_pNNN_hnsw_b_D (second),
-- attached to memories_hnsw_D / memories_hnsw_b_D, which becomes valid when the last is attached.
CREATE FUNCTION tokensvc.ensure_memory_partition_index(dim integer, slot integer, part integer)
RETURNS boolean LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    suffix text := CASE WHEN slot = 1 THEN 'b_' ELSE '' END;
    vec text := CASE WHEN slot = 1 THEN 'embedding_b' ELSE 'embedding' END;
    dimcol text := CASE WHEN slot = 1 THEN 'dimension_b' ELSE 'dimension' END;
    parent text := 'memories_hnsw_' || suffix || dim;
    partition text := 'memories_p' || lpad(part::text, 3, '0');
    child text := 'memories_p' || lpad(part::text, 3, '0') || '_hnsw_' || suffix || dim;
BEGIN
    IF dim < 1 OR dim > 2000 OR slot NOT IN (0, 1) OR part < 0 OR part > 999
       OR to_regclass('tokensvc.' || partition) IS NULL THEN
        RETURN false;
    END IF;
    PERFORM pg_advisory_xact_lock(hashtextextended('tokensvc.' || parent, 0));
    IF to_regclass('tokensvc.' || parent) IS NULL THEN
        EXECUTE format(
            'CREATE INDEX %I ON ONLY tokensvc.memories '
            'USING hnsw ((%I::vector(%s)) vector_ip_ops) WITH (m = 16, ef_construction = 64) '
            'WHERE %I = %s', parent, vec, dim, dimcol, dim);
    END IF;
    IF to_regclass('tokensvc.' || child) IS NULL THEN
        EXECUTE format(
            'CREATE INDEX %I ON tokensvc.%I '
            'USING hnsw ((%I::vector(%s)) vector_ip_ops) WITH (m = 16, ef_construction = 64) '
            'WHERE %I = %s', child, partition, vec, dim, dimcol, dim);
        EXECUTE format('ALTER INDEX tokensvc.%I ATTACH PARTITION tokensvc.%I', parent, child);
    END IF;
    RETURN true;
END $$;
REVOKE ALL ON FUNCTION tokensvc.ensure_memory_partition_index(integer, integer, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION tokensvc.ensure_memory_partition_index(integer, integer, integer) TO {app_role};

-- Whether (slot, dimension) is indexed on every partition (or needs no HNSW index: too wide).
CREATE FUNCTION tokensvc.memory_vector_index_ready(dim integer, slot integer) RETURNS boolean
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
    SELECT dim > 2000 OR coalesce((SELECT i.indisvalid FROM pg_index i WHERE i.indexrelid = to_regclass(
        'tokensvc.memories_hnsw_' || CASE WHEN slot = 1 THEN 'b_' ELSE '' END || dim)), false)
$$;
REVOKE ALL ON FUNCTION tokensvc.memory_vector_index_ready(integer, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION tokensvc.memory_vector_index_ready(integer, integer) TO {app_role};

-- The generation guard. A writer declares the generation it embedded for
-- (`tokensvc.generation`); its row is refused (SQLSTATE TK001) when the space has moved on, so a
-- replica still holding the old pin re-reads it and embeds again, never writing old-model
-- vectors into a generation that no longer reads them. The share lock on the space row orders
-- every write with a cutover (which takes the row FOR UPDATE): a write either commits before the
-- cutover checks for rows the migration has not embedded, or waits and then sees the new
-- generation. The other slot keeps a vector a writer put there only when the writer declared the
-- space's backfilling migration (`tokensvc.dual_write`, its id): a replica that still believes in
-- a cancelled or finished migration cannot leave its target's vectors behind. A content change
-- also clears the other slot, whose vector is of the old content, unless the same statement wrote
-- it.
CREATE FUNCTION tokensvc.memories_generation_guard() RETURNS trigger
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
        -- FOR SHARE: a cancel (an UPDATE of this row) waits for the write, and a write after it
        -- sees the migration is no longer backfilling.
        SELECT m.id INTO backfilling FROM tokensvc.embedding_migrations m
        WHERE m.namespace = NEW.namespace AND m.agent = NEW.agent AND m.state = 'backfilling' FOR SHARE;
        keep := backfilling IS NOT NULL AND backfilling::text = dual_write;
    END IF;
    -- Emptied: another slot vector this write may not keep, or one of the content it replaces.
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
REVOKE ALL ON FUNCTION tokensvc.memories_generation_guard() FROM PUBLIC;
CREATE TRIGGER memories_generation_guard BEFORE INSERT OR UPDATE ON tokensvc.memories
    FOR EACH ROW EXECUTE FUNCTION tokensvc.memories_generation_guard();

-- The migration runner reads and writes every bucket of the one space it migrates, through these
-- owner functions: a policy for it would be OR-ed into every tenant query's row-level security,
-- which then could no longer be an index condition (measured: +0.1 ms on a 400-row bucket's
-- search). The owner's own UPDATE policy is for them only (the serving role has no such policy).
DO $$
BEGIN
    EXECUTE format('CREATE POLICY memories_owner_migration ON tokensvc.memories FOR UPDATE TO %I '
                   'USING (true)', current_user);
END $$;

-- One row per migration: what it moves to, where it is, and who runs it (a lease, so one replica
-- runs it at a time and another takes over when the runner dies).
CREATE TABLE tokensvc.embedding_migrations (
    id              uuid        PRIMARY KEY,
    namespace       text        NOT NULL,
    agent           text        NOT NULL,
    from_generation integer     NOT NULL,
    from_embedder   text        NOT NULL,
    from_model      text        NOT NULL,
    from_dimension  integer     NOT NULL,
    to_embedder     text        NOT NULL,
    to_model        text        NOT NULL,
    to_dimension    integer     NOT NULL CHECK (to_dimension BETWEEN 1 AND 16000),
    to_normalized   boolean     NOT NULL,
    state           text        NOT NULL
        CHECK (state IN ('backfilling', 'paused', 'retiring', 'succeeded', 'cancelling', 'cancelled')),
    reason          text        NOT NULL DEFAULT '',
    rows_total      bigint      NOT NULL DEFAULT 0,
    rows_done       bigint      NOT NULL DEFAULT 0,
    -- Where the backfill (or the clean-up) has got to, in (bucket, id) order.
    cursor_bucket   text,
    cursor_id       uuid,
    failures        integer     NOT NULL DEFAULT 0,
    lease_owner     text,
    lease_until     timestamptz,
    created_by      text        NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    cut_over_at     timestamptz,
    finished_at     timestamptz
);
-- One migration at a time per space, until its clean-up is done (it uses the space's other slot).
CREATE UNIQUE INDEX embedding_migrations_one_per_space ON tokensvc.embedding_migrations (namespace, agent)
    WHERE state IN ('backfilling', 'paused', 'retiring', 'cancelling');
CREATE INDEX embedding_migrations_active ON tokensvc.embedding_migrations (created_at)
    WHERE state IN ('backfilling', 'retiring', 'cancelling');
REVOKE DELETE, TRUNCATE ON tokensvc.embedding_migrations FROM {app_role};

-- Each runner function acts for one migration only: it takes the migration's id and the runner's
-- name, refuses (raises) unless the migration is in the state that work belongs to and the runner
-- holds its lease, and derives the space, the slot and the dimension from the migration's row, so
-- nothing a caller passes can point it at another space or at the slot a space reads.
CREATE FUNCTION tokensvc.leased_migration(migration uuid, runner text, wanted text[])
RETURNS tokensvc.embedding_migrations LANGUAGE plpgsql
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    m tokensvc.embedding_migrations;
BEGIN
    SELECT * INTO m FROM tokensvc.embedding_migrations WHERE id = migration FOR UPDATE;
    IF NOT FOUND OR m.state <> ALL (wanted) OR runner IS NULL OR m.lease_owner IS DISTINCT FROM runner
       OR m.lease_until IS NULL OR m.lease_until < clock_timestamp() THEN
        RAISE EXCEPTION 'migration % is not leased to this runner in state %', migration, wanted
            USING ERRCODE = 'TK002';
    END IF;
    RETURN m;
END $$;
REVOKE ALL ON FUNCTION tokensvc.leased_migration(uuid, text, text[]) FROM PUBLIC;

-- Up to `lim` (1..10000) live memories of the migration's space without a vector of its target
-- dimension in its target slot, in (bucket, id) order after the cursor (both NULL: the start).
CREATE FUNCTION tokensvc.migration_pending(migration uuid, runner text, after_bucket text,
                                           after_id uuid, lim integer)
RETURNS TABLE (bucket text, id uuid, content text, content_sha256 bytea)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    m tokensvc.embedding_migrations := tokensvc.leased_migration(migration, runner, ARRAY['backfilling']);
    slot integer := (m.from_generation + 1) % 2;
BEGIN
    IF lim IS NULL OR lim < 1 OR lim > 10000 OR (after_bucket IS NULL) <> (after_id IS NULL) THEN
        RAISE EXCEPTION 'a batch of 1 to 10000 memories after a whole cursor';
    END IF;
    RETURN QUERY
    SELECT x.bucket, x.id, x.content, x.content_sha256 FROM tokensvc.memories x
    WHERE x.namespace = m.namespace AND x.agent = m.agent AND (x.expires_at IS NULL OR x.expires_at > now())
      AND CASE WHEN slot = 0 THEN x.dimension ELSE x.dimension_b END IS DISTINCT FROM m.to_dimension
      AND (after_bucket IS NULL OR (x.bucket, x.id) > (after_bucket, after_id))
    ORDER BY x.bucket, x.id LIMIT lim;
END $$;

-- The target vectors of these memories of the migration's space, each unless its content changed
-- since it was read (its hash differs); returns how many were written.
CREATE FUNCTION tokensvc.migration_store(migration uuid, runner text, buckets text[], ids uuid[],
                                         hashes bytea[], vectors vector[])
RETURNS integer LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    m tokensvc.embedding_migrations := tokensvc.leased_migration(migration, runner, ARRAY['backfilling']);
    written integer;
BEGIN
    IF EXISTS (SELECT 1 FROM unnest(vectors) v WHERE vector_dims(v) <> m.to_dimension) THEN
        RAISE EXCEPTION 'a vector is not of the migration''s dimension %', m.to_dimension;
    END IF;
    IF (m.from_generation + 1) % 2 = 0 THEN
        UPDATE tokensvc.memories x SET embedding = u.v, dimension = m.to_dimension
        FROM unnest(buckets, ids, hashes, vectors) AS u(b, i, h, v)
        WHERE x.bucket = u.b AND x.id = u.i AND x.content_sha256 = u.h
          AND x.namespace = m.namespace AND x.agent = m.agent;
    ELSE
        UPDATE tokensvc.memories x SET embedding_b = u.v, dimension_b = m.to_dimension
        FROM unnest(buckets, ids, hashes, vectors) AS u(b, i, h, v)
        WHERE x.bucket = u.b AND x.id = u.i AND x.content_sha256 = u.h
          AND x.namespace = m.namespace AND x.agent = m.agent;
    END IF;
    GET DIAGNOSTICS written = ROW_COUNT;
    RETURN written;
END $$;

-- Empties the slot the migration leaves behind (RETIRING: the old generation's; CANCELLING: its
-- target's) in the next `lim` memories of its space after its cursor (expired ones too), moves
-- the cursor past them and renews the lease; returns how many memories the batch held (0: done).
CREATE FUNCTION tokensvc.migration_clear(migration uuid, runner text, lim integer, lease_seconds float8)
RETURNS integer LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    m tokensvc.embedding_migrations :=
        tokensvc.leased_migration(migration, runner, ARRAY['retiring', 'cancelling']);
    slot integer := CASE WHEN m.state = 'retiring' THEN m.from_generation % 2
                         ELSE (m.from_generation + 1) % 2 END;
    held integer;
    last_bucket text;
    last_id uuid;
BEGIN
    IF lim IS NULL OR lim < 1 OR lim > 10000 THEN
        RAISE EXCEPTION 'a batch of 1 to 10000 memories';
    END IF;
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
    UPDATE tokensvc.embedding_migrations
    SET cursor_bucket = coalesce(last_bucket, cursor_bucket), cursor_id = coalesce(last_id, cursor_id),
        lease_until = clock_timestamp() + make_interval(secs => lease_seconds), updated_at = clock_timestamp()
    WHERE id = migration;
    RETURN held;
END $$;

-- The live memories of a space and their average length: what a migration of it has to embed
-- (counts only, never content).
CREATE FUNCTION tokensvc.migration_space_size(ns text, ag text, OUT live bigint, OUT average_chars integer)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
    SELECT count(*), coalesce(avg(length(x.content)), 0)::integer FROM tokensvc.memories x
    WHERE x.namespace = ns AND x.agent = ag AND (x.expires_at IS NULL OR x.expires_at > now())
$$;
DO $$
DECLARE
    f text;
BEGIN
    FOREACH f IN ARRAY ARRAY[
        'migration_pending(uuid, text, text, uuid, integer)',
        'migration_store(uuid, text, text[], uuid[], bytea[], vector[])',
        'migration_clear(uuid, text, integer, float8)',
        'migration_space_size(text, text)']
    LOOP
        EXECUTE format('REVOKE ALL ON FUNCTION tokensvc.%s FROM PUBLIC', f);
        EXECUTE format('GRANT EXECUTE ON FUNCTION tokensvc.%s TO {app_role}', f);
    END LOOP;
END $$;
-- The whole-table index build of 0013 is the owner's now: the serving role builds one partition
-- per transaction (ensure_memory_partition_index).
REVOKE EXECUTE ON FUNCTION tokensvc.ensure_memory_vector_index(integer) FROM {app_role};

-- The cutover, as the owner (the serving role cannot change a pin): with the space row locked, so
-- no write is in flight, it checks that every live memory of the space has a vector in the target
-- slot, then pins the target and bumps the generation. Returns false (and changes nothing) when a
-- row is missing one, or when the caller no longer holds the migration's lease.
CREATE FUNCTION tokensvc.cut_over_memory_space(migration uuid, runner text) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    m tokensvc.embedding_migrations;
    current_generation integer;
BEGIN
    SELECT * INTO m FROM tokensvc.embedding_migrations WHERE id = migration FOR UPDATE;
    IF NOT FOUND OR m.state <> 'backfilling' OR runner IS NULL OR m.lease_owner IS DISTINCT FROM runner
       OR m.lease_until IS NULL OR m.lease_until < clock_timestamp() THEN
        RETURN false;
    END IF;
    PERFORM set_config('tokensvc.namespace', m.namespace, true);
    PERFORM set_config('tokensvc.agent', m.agent, true);
    SELECT generation INTO current_generation FROM tokensvc.memory_spaces
    WHERE namespace = m.namespace AND agent = m.agent FOR UPDATE;
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
    SET state = 'retiring', cut_over_at = clock_timestamp(), updated_at = clock_timestamp(),
        cursor_bucket = NULL, cursor_id = NULL
    WHERE id = migration;
    -- Audited in the same transaction: a crash cannot keep the cutover and lose its record.
    INSERT INTO tokensvc.audit_events (kind, actor, action, target, outcome, detail)
    VALUES ('embedding_migration', 'system:tokensvc', 'cut over embedding migration',
            format('migration:%s space:%s/%s', m.id, m.namespace, m.agent), 'succeeded',
            format('the space now reads %s (%s)', m.to_embedder, m.to_dimension));
    RETURN true;
END $$;
REVOKE ALL ON FUNCTION tokensvc.cut_over_memory_space(uuid, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION tokensvc.cut_over_memory_space(uuid, text) TO {app_role};
