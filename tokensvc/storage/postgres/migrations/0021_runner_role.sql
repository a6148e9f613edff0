-- The re-embedding runner gets a role of its own, and the serving role loses every path to rows
-- outside the buckets its transaction declared (issue 35, finding F12).
--
-- Before: the serving role could INSERT and UPDATE `embedding_migrations` (no row-level security),
-- and the runner's SECURITY DEFINER functions trust that row (its space, slot, dimension, lease):
-- a forged `backfilling` row made migration_pending hand out every bucket id and memory of a
-- space, migration_store + cut_over_memory_space re-pinned a space, a forged `retiring` row made
-- migration_clear empty the slot a live space reads. Now:
--
-- * the serving role may only read the table (not the backfill cursor, which holds a bucket id),
--   and creates and moves migrations through functions that check their input: the subject the
--   transaction declared and its current pin (the source is read, never taken from the caller),
--   a whole target (never the built-in `hash` embedder for a subject pinned to another: it is for
--   tests, and always configured), and the operator's transitions of the state machine only
--   (cancel, resume, a start's release), each for the subject its transaction declared;
-- * the runner's functions (claim, lease, batches, clean-up, cutover, finish) are executable by
--   the runner group role `{runner_role}` only, whose login role the service's runner pool uses
--   (its own credential); migration_pending answers only a transaction that declared the space;
-- * the HNSW builds the serving role may ask for are limited to dimensions something uses, and
--   to 16 distinct dimensions in all (a pin the serving role inserts makes a dimension "used").
--
-- `{runner_role}` is substituted like `{app_role}` (a validated identifier); the group role is
-- created by whoever provisions roles (docs/operations.md, "The runner credential"), as the
-- serving group is: the schema owner need not be able to create roles.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{runner_role}') THEN
        RAISE EXCEPTION 'role {runner_role} does not exist: create it first (CREATE ROLE {runner_role} NOLOGIN, '
            'and a login role in it; docs/operations.md, "The runner credential")'
            USING ERRCODE = '42704';
    END IF;
    -- The runner's login connects like the serving one. The schema owner may not own the database
    -- (then the DBA grants CONNECT, as for the serving group).
    BEGIN
        EXECUTE format('GRANT CONNECT ON DATABASE %I TO {runner_role}', current_database());
    EXCEPTION WHEN insufficient_privilege THEN
        RAISE NOTICE 'grant CONNECT on database % to {runner_role} as its owner', current_database();
    END;
END $$;

GRANT USAGE ON SCHEMA tokensvc TO {runner_role};
GRANT SELECT ON tokensvc.schema_migrations TO {runner_role};
GRANT SELECT ON tokensvc.embedding_migrations TO {runner_role};

-- The serving role reads migrations (status, list, the gauges, an upload's dual write) and writes
-- none: every column but the backfill cursor, whose bucket id only the runner may know.
REVOKE INSERT, UPDATE, SELECT ON tokensvc.embedding_migrations FROM {app_role};
GRANT SELECT (id, namespace, agent, kb_ref, from_generation, from_embedder, from_model, from_dimension,
              to_embedder, to_model, to_dimension, to_normalized, from_chunking, from_chunk_size,
              from_chunk_overlap, to_chunking, to_chunk_size, to_chunk_overlap, state, reason, rows_total,
              rows_done, failures, lease_owner, lease_until, created_by, created_at, updated_at,
              cut_over_at, finished_at, cursor_document)
    ON tokensvc.embedding_migrations TO {app_role};
-- A pinned space is never re-pinned by the serving role: UPDATE was revoked in 0003, and a DELETE
-- followed by an INSERT would do the same (the service never deletes a space). The privilege
-- stays (on Citus every INSERT into a reference table locks its other placements with
-- lock_shard_resources, which requires UPDATE, DELETE or TRUNCATE on the table: Citus's
-- resource_lock.c); instead, the tenant policy is split by command and none allows a DELETE, so no
-- row can be deleted by anyone but a superuser. (A RESTRICTIVE policy would do on one node, but
-- Citus creates it on the shards as a permissive one.) The owner's re-pin at a cutover keeps its
-- UPDATE policy; the serving role has no UPDATE privilege.
DROP POLICY memory_spaces_tenant ON tokensvc.memory_spaces;
CREATE POLICY memory_spaces_tenant_read ON tokensvc.memory_spaces FOR SELECT
    USING (namespace = current_setting('tokensvc.namespace', true)
           AND agent = current_setting('tokensvc.agent', true));
CREATE POLICY memory_spaces_tenant_pin ON tokensvc.memory_spaces FOR INSERT
    WITH CHECK (namespace = current_setting('tokensvc.namespace', true)
                AND agent = current_setting('tokensvc.agent', true));
CREATE POLICY memory_spaces_tenant_repin ON tokensvc.memory_spaces FOR UPDATE
    USING (namespace = current_setting('tokensvc.namespace', true)
           AND agent = current_setting('tokensvc.agent', true))
    WITH CHECK (namespace = current_setting('tokensvc.namespace', true)
                AND agent = current_setting('tokensvc.agent', true));

-- The owner reads every knowledge base's pin for ensure_chunk_vector_index only (as 0016 lets it
-- list memory spaces): tenant queries' row-level security is unchanged.
DO $$
BEGIN
    EXECUTE format('CREATE POLICY knowledge_bases_owner_listing ON tokensvc.knowledge_bases FOR SELECT TO %I '
                   'USING (true)', current_user);
END $$;

-- Whether a migration row may be shown to the serving role: its backfill cursor (a bucket id) is
-- the runner's only.
CREATE FUNCTION tokensvc.migration_as_served(m tokensvc.embedding_migrations)
RETURNS tokensvc.embedding_migrations LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
BEGIN
    m.cursor_bucket := NULL;
    m.cursor_id := NULL;
    RETURN m;
END $$;
REVOKE ALL ON FUNCTION tokensvc.migration_as_served(tokensvc.embedding_migrations) FROM PUBLIC;

-- ---------------------------------------------------------------------------------------------
-- The control plane's functions (the serving role: the admin RPCs and a knowledge base's delete)
-- ---------------------------------------------------------------------------------------------

-- A memory space's migration to `target_*`, for the space the transaction declared, from its pin
-- as it is now (read here, not taken from the caller) at `generation_at_start`, held for its start
-- (release_started_migration). No row (nothing recorded) when the space is not at that generation
-- or already has an unfinished migration.
CREATE FUNCTION tokensvc.start_memory_migration(
    migration uuid, ns text, ag text, generation_at_start integer, target_embedder text,
    target_model text, target_dimension integer, target_normalized boolean, rows bigint, actor text)
RETURNS SETOF tokensvc.embedding_migrations LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    s record;
    m tokensvc.embedding_migrations;
BEGIN
    IF migration IS NULL OR ns IS DISTINCT FROM current_setting('tokensvc.namespace', true)
       OR ag IS DISTINCT FROM current_setting('tokensvc.agent', true) OR ns = '' OR ag = '' THEN
        RAISE EXCEPTION 'a migration starts for the memory space its transaction declared'
            USING ERRCODE = '42501';
    END IF;
    IF length(target_embedder) NOT BETWEEN 1 AND 256 OR length(target_model) NOT BETWEEN 1 AND 256
       OR target_dimension NOT BETWEEN 1 AND 16000 OR target_normalized IS NULL OR rows < 0
       OR length(actor) NOT BETWEEN 1 AND 1024 OR generation_at_start IS NULL
       OR target_dimension IS NULL OR rows IS NULL OR target_embedder IS NULL OR target_model IS NULL
       OR actor IS NULL THEN
        RAISE EXCEPTION 'a migration needs a whole target embedder, a row count and an actor'
            USING ERRCODE = '22023';
    END IF;
    SELECT sp.embedder, sp.model, sp.dimension, sp.normalized, sp.generation INTO s
    FROM tokensvc.memory_spaces sp WHERE sp.namespace = ns AND sp.agent = ag;
    IF NOT FOUND OR s.generation IS DISTINCT FROM generation_at_start THEN
        RETURN;
    END IF;
    IF (s.embedder, s.model, s.dimension, s.normalized)
       = (target_embedder, target_model, target_dimension, target_normalized) THEN
        RAISE EXCEPTION 'the memory space is pinned to this embedder already' USING ERRCODE = '22023';
    END IF;
    IF target_embedder = 'hash' AND s.embedder <> 'hash' THEN
        RAISE EXCEPTION 'the built-in hash embedder is for tests: no space pinned to another migrates to it'
            USING ERRCODE = '22023';
    END IF;
    INSERT INTO tokensvc.embedding_migrations (id, namespace, agent, from_generation, from_embedder,
        from_model, from_dimension, to_embedder, to_model, to_dimension, to_normalized, state, rows_total,
        created_by, lease_owner, lease_until)
    VALUES (migration, ns, ag, s.generation, s.embedder, s.model, s.dimension, target_embedder,
            target_model, target_dimension, target_normalized, 'backfilling', rows, actor,
            'tokensvc:starting', statement_timestamp() + interval '15 minutes')
    ON CONFLICT DO NOTHING
    RETURNING * INTO m;
    IF m.id IS NOT NULL THEN
        RETURN NEXT tokensvc.migration_as_served(m);
    END IF;
END $$;

-- A knowledge base's migration, for the base the transaction declared (its namespace and the
-- base in its roster), from its pins as they are now, to a whole target embedder and chunking.
CREATE FUNCTION tokensvc.start_knowledge_migration(
    migration uuid, ns text, kb text, generation_at_start integer, target_embedder text,
    target_model text, target_dimension integer, target_normalized boolean, target_chunking text,
    target_chunk_size integer, target_chunk_overlap integer, rows bigint, actor text)
RETURNS SETOF tokensvc.embedding_migrations LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    b record;
    m tokensvc.embedding_migrations;
BEGIN
    IF migration IS NULL OR kb IS NULL OR ns IS DISTINCT FROM current_setting('tokensvc.namespace', true)
       OR NOT tokensvc.kb_visible(ns, kb) THEN
        RAISE EXCEPTION 'a migration starts for the knowledge base its transaction declared'
            USING ERRCODE = '42501';
    END IF;
    IF length(target_embedder) NOT BETWEEN 1 AND 256 OR length(target_model) NOT BETWEEN 1 AND 256
       OR target_dimension NOT BETWEEN 1 AND 16000 OR target_normalized IS NULL OR rows < 0
       OR target_chunking NOT IN ('fixed', 'recursive', 'markdown') OR target_chunk_size < 1
       OR target_chunk_overlap < 0 OR target_chunk_overlap >= target_chunk_size
       OR length(actor) NOT BETWEEN 1 AND 1024 OR generation_at_start IS NULL
       OR target_dimension IS NULL OR rows IS NULL OR target_embedder IS NULL OR target_model IS NULL
       OR target_chunking IS NULL OR target_chunk_size IS NULL OR target_chunk_overlap IS NULL
       OR actor IS NULL THEN
        RAISE EXCEPTION 'a migration needs a whole target embedder and chunking, a row count and an actor'
            USING ERRCODE = '22023';
    END IF;
    SELECT k.embedder, k.model, k.dimension, k.normalized, k.chunking, k.chunk_size, k.chunk_overlap,
           k.generation INTO b
    FROM tokensvc.knowledge_bases k WHERE k.namespace = ns AND k.ref = kb;
    IF NOT FOUND OR b.generation IS DISTINCT FROM generation_at_start THEN
        RETURN;
    END IF;
    IF (b.embedder, b.model, b.dimension, b.normalized, b.chunking, b.chunk_size, b.chunk_overlap)
       = (target_embedder, target_model, target_dimension, target_normalized, target_chunking,
          target_chunk_size, target_chunk_overlap) THEN
        RAISE EXCEPTION 'the knowledge base is pinned to this embedder and chunking already'
            USING ERRCODE = '22023';
    END IF;
    IF target_embedder = 'hash' AND b.embedder <> 'hash' THEN
        RAISE EXCEPTION 'the built-in hash embedder is for tests: no base pinned to another migrates to it'
            USING ERRCODE = '22023';
    END IF;
    INSERT INTO tokensvc.embedding_migrations (id, namespace, kb_ref, from_generation, from_embedder,
        from_model, from_dimension, to_embedder, to_model, to_dimension, to_normalized, from_chunking,
        from_chunk_size, from_chunk_overlap, to_chunking, to_chunk_size, to_chunk_overlap, state,
        rows_total, created_by, lease_owner, lease_until)
    VALUES (migration, ns, kb, b.generation, b.embedder, b.model, b.dimension, target_embedder,
            target_model, target_dimension, target_normalized, b.chunking, b.chunk_size, b.chunk_overlap,
            target_chunking, target_chunk_size, target_chunk_overlap, 'backfilling', rows, actor,
            'tokensvc:starting', statement_timestamp() + interval '15 minutes')
    ON CONFLICT DO NOTHING
    RETURNING * INTO m;
    IF m.id IS NOT NULL THEN
        RETURN NEXT tokensvc.migration_as_served(m);
    END IF;
END $$;

-- Whether the transaction declared migration `m`'s subject: its memory space (namespace and
-- agent), or its knowledge base (the namespace, the base in its roster). A migration's subject
-- never changes once it is recorded, so the check holds for the rest of the transaction.
CREATE FUNCTION tokensvc.migration_subject_declared(m tokensvc.embedding_migrations) RETURNS boolean
LANGUAGE sql STABLE SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
    SELECT CASE WHEN m.kb_ref IS NOT NULL THEN coalesce(tokensvc.kb_visible(m.namespace, m.kb_ref), false)
                ELSE m.agent IS NOT NULL
                     AND m.namespace IS NOT DISTINCT FROM current_setting('tokensvc.namespace', true)
                     AND m.agent IS NOT DISTINCT FROM current_setting('tokensvc.agent', true) END
$$;
REVOKE ALL ON FUNCTION tokensvc.migration_subject_declared(tokensvc.embedding_migrations) FROM PUBLIC;

-- A start's row is leased to no runner until its target's index is built (the start does that
-- after the row exists, since a build is refused for a dimension nothing uses): then this
-- releases it, for a transaction that declared its subject, while it is BACKFILLING. A start
-- that dies before it does leaves the lease to expire (15 minutes).
CREATE FUNCTION tokensvc.release_started_migration(migration uuid)
RETURNS SETOF tokensvc.embedding_migrations LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    m tokensvc.embedding_migrations;
BEGIN
    SELECT * INTO m FROM tokensvc.embedding_migrations WHERE id = migration;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF NOT tokensvc.migration_subject_declared(m) THEN
        RAISE EXCEPTION 'a start is released by a transaction that declared its subject' USING ERRCODE = '42501';
    END IF;
    m := NULL;
    UPDATE tokensvc.embedding_migrations SET lease_owner = NULL, lease_until = NULL
    WHERE id = migration AND lease_owner = 'tokensvc:starting' AND state = 'backfilling'
    RETURNING * INTO m;
    IF m.id IS NOT NULL THEN
        RETURN NEXT tokensvc.migration_as_served(m);
    END IF;
END $$;

-- The operator's transitions: cancel (BACKFILLING or PAUSED to CANCELLING, the clean-up walking
-- from the start) and resume (PAUSED to BACKFILLING); the lease is released. For a transaction
-- that declared the migration's subject (checked before anything is locked); the subject row is
-- locked first (0015's lock order), and the caller's declaration is left as it was (the lock
-- narrows `tokensvc.kbs` to the one base). No row when the migration is in none of `expected`
-- (those the transition allows).
CREATE FUNCTION tokensvc.change_migration_state(migration uuid, expected text[], new_state text, why text)
RETURNS SETOF tokensvc.embedding_migrations LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    allowed text[] := CASE new_state WHEN 'cancelling' THEN ARRAY['backfilling', 'paused']
                                     WHEN 'backfilling' THEN ARRAY['paused'] END;
    m tokensvc.embedding_migrations;
    roster text := current_setting('tokensvc.kbs', true);
BEGIN
    IF allowed IS NULL OR expected IS NULL OR why IS NULL OR length(why) > 1024 THEN
        RAISE EXCEPTION 'the control plane cancels or resumes a migration, nothing else'
            USING ERRCODE = '22023';
    END IF;
    SELECT * INTO m FROM tokensvc.embedding_migrations WHERE id = migration;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF NOT tokensvc.migration_subject_declared(m) THEN
        RAISE EXCEPTION 'a migration is cancelled or resumed by a transaction that declared its subject'
            USING ERRCODE = '42501';
    END IF;
    m := NULL;
    IF NOT tokensvc.lock_migration_subject(migration, true) THEN
        RETURN;
    END IF;
    -- The namespace and agent it set are the caller's already (checked above); the roster is not.
    PERFORM set_config('tokensvc.kbs', coalesce(roster, ''), true);
    UPDATE tokensvc.embedding_migrations
    SET state = new_state, reason = why, failures = 0, lease_owner = NULL, lease_until = NULL,
        updated_at = statement_timestamp(), finished_at = NULL,
        cursor_bucket = CASE WHEN new_state = 'cancelling' THEN NULL ELSE cursor_bucket END,
        cursor_id = CASE WHEN new_state = 'cancelling' THEN NULL ELSE cursor_id END,
        cursor_document = CASE WHEN new_state = 'cancelling' THEN NULL ELSE cursor_document END
    WHERE id = migration AND state = ANY (expected) AND state = ANY (allowed)
    RETURNING * INTO m;
    IF m.id IS NOT NULL THEN
        RETURN NEXT tokensvc.migration_as_served(m);
    END IF;
END $$;

-- A knowledge base's delete ends its unfinished migration (its chunks go with its documents), in
-- the delete's transaction, for the base that transaction declared. Returns how many.
CREATE FUNCTION tokensvc.cancel_knowledge_base_migrations(ns text, kb text) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    ended integer;
BEGIN
    IF kb IS NULL OR ns IS DISTINCT FROM current_setting('tokensvc.namespace', true)
       OR NOT tokensvc.kb_visible(ns, kb) THEN
        RAISE EXCEPTION 'only the knowledge base the transaction declared' USING ERRCODE = '42501';
    END IF;
    UPDATE tokensvc.embedding_migrations
    SET state = 'cancelled', lease_owner = NULL, lease_until = NULL, reason = 'the knowledge base was deleted',
        updated_at = statement_timestamp(), finished_at = statement_timestamp()
    WHERE namespace = ns AND kb_ref = kb AND state IN ('backfilling', 'paused', 'retiring', 'cancelling');
    GET DIAGNOSTICS ended = ROW_COUNT;
    RETURN ended;
END $$;

-- ---------------------------------------------------------------------------------------------
-- The runner's functions ({runner_role} only)
-- ---------------------------------------------------------------------------------------------

-- The lease of the oldest runnable migration whose lease is free, expired or `runner`'s own, not
-- one of `busy`; a BACKFILLING one only when its target embedder is among `embedders`, a RETIRING
-- one `retire_after` seconds after its cutover.
CREATE FUNCTION tokensvc.claim_migration(runner text, lease_seconds float8, embedders text[],
                                         retire_after float8, busy uuid[])
RETURNS SETOF tokensvc.embedding_migrations LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
BEGIN
    IF length(runner) NOT BETWEEN 1 AND 256 OR NOT lease_seconds BETWEEN 0.001 AND 3600
       OR NOT retire_after >= 0 OR runner IS NULL OR lease_seconds IS NULL OR retire_after IS NULL THEN
        RAISE EXCEPTION 'a claim needs a runner, a lease of up to an hour and a retirement delay'
            USING ERRCODE = '22023';
    END IF;
    RETURN QUERY
    UPDATE tokensvc.embedding_migrations SET lease_owner = runner, updated_at = statement_timestamp(),
        lease_until = statement_timestamp() + make_interval(secs => lease_seconds)
    WHERE id = (SELECT c.id FROM tokensvc.embedding_migrations c
                WHERE c.state IN ('backfilling', 'retiring', 'cancelling')
                  AND (c.state <> 'backfilling' OR c.to_embedder = ANY (coalesce(embedders, '{}')))
                  AND (c.state <> 'retiring'
                       OR c.cut_over_at + make_interval(secs => retire_after) <= statement_timestamp())
                  AND (c.lease_owner IS NULL OR c.lease_owner = runner OR c.lease_until < statement_timestamp())
                  AND c.id <> ALL (coalesce(busy, '{}'))
                ORDER BY c.created_at, c.id LIMIT 1 FOR UPDATE SKIP LOCKED)
    RETURNING *;
END $$;

-- Extends `runner`'s lease of a runnable migration (an expired one too, when nobody took it).
CREATE FUNCTION tokensvc.renew_migration(migration uuid, runner text, lease_seconds float8) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
BEGIN
    IF NOT lease_seconds BETWEEN 0.001 AND 3600 OR lease_seconds IS NULL THEN
        RAISE EXCEPTION 'a lease of up to an hour' USING ERRCODE = '22023';
    END IF;
    UPDATE tokensvc.embedding_migrations
    SET lease_until = statement_timestamp() + make_interval(secs => lease_seconds)
    WHERE id = migration AND lease_owner = runner AND state IN ('backfilling', 'retiring', 'cancelling');
    RETURN FOUND;
END $$;

-- The backfill's cursor back to the start, for the runner holding the lease.
CREATE FUNCTION tokensvc.rewind_migration(migration uuid, runner text) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
BEGIN
    UPDATE tokensvc.embedding_migrations
    SET cursor_bucket = NULL, cursor_id = NULL, cursor_document = NULL, updated_at = statement_timestamp()
    WHERE id = migration AND lease_owner = runner AND lease_until >= statement_timestamp();
    RETURN FOUND;
END $$;

-- A consecutive embedder failure of the runner holding the lease; at `pause_after` of them the
-- migration pauses (its lease released). Not a CASE around a volatile function: Citus refuses one.
CREATE FUNCTION tokensvc.migration_failed(migration uuid, runner text, why text, pause_after integer)
RETURNS SETOF tokensvc.embedding_migrations LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
BEGIN
    IF why IS NULL OR pause_after IS NULL OR pause_after < 1 THEN
        RAISE EXCEPTION 'a failure needs a reason and a pause threshold' USING ERRCODE = '22023';
    END IF;
    RETURN QUERY
    UPDATE tokensvc.embedding_migrations SET failures = failures + 1, reason = left(why, 1024),
        updated_at = statement_timestamp(),
        state = CASE WHEN failures + 1 >= pause_after THEN 'paused' ELSE state END,
        lease_owner = CASE WHEN failures + 1 >= pause_after THEN NULL ELSE lease_owner END,
        lease_until = CASE WHEN failures + 1 >= pause_after THEN NULL ELSE lease_until END
    WHERE id = migration AND lease_owner = runner AND lease_until >= statement_timestamp()
    RETURNING *;
END $$;

-- The runner's transitions: a clean-up's end (RETIRING to SUCCEEDED; CANCELLING, or a migration
-- whose subject is gone, to CANCELLED) and a pause (BACKFILLING to PAUSED); the lease is released.
-- The subject row is locked first (0015's lock order).
CREATE FUNCTION tokensvc.finish_migration(migration uuid, expected text[], new_state text, why text)
RETURNS SETOF tokensvc.embedding_migrations LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    allowed text[] := CASE new_state WHEN 'succeeded' THEN ARRAY['retiring']
                                     WHEN 'cancelled' THEN ARRAY['backfilling', 'paused', 'retiring', 'cancelling']
                                     WHEN 'paused' THEN ARRAY['backfilling'] END;
BEGIN
    IF allowed IS NULL OR expected IS NULL OR why IS NULL OR length(why) > 1024 THEN
        RAISE EXCEPTION 'the runner finishes or pauses a migration, nothing else' USING ERRCODE = '22023';
    END IF;
    IF NOT tokensvc.lock_migration_subject(migration, true) THEN
        RETURN;
    END IF;
    IF new_state = 'paused' THEN
        RETURN QUERY
        UPDATE tokensvc.embedding_migrations
        SET state = new_state, reason = why, failures = 0, lease_owner = NULL, lease_until = NULL,
            updated_at = statement_timestamp(), finished_at = NULL
        WHERE id = migration AND state = ANY (expected) AND state = ANY (allowed)
        RETURNING *;
    ELSE
        RETURN QUERY
        UPDATE tokensvc.embedding_migrations
        SET state = new_state, reason = why, failures = 0, lease_owner = NULL, lease_until = NULL,
            updated_at = statement_timestamp(), finished_at = statement_timestamp()
        WHERE id = migration AND state = ANY (expected) AND state = ANY (allowed)
        RETURNING *;
    END IF;
END $$;

-- 0019's read of a space's backfill, for a transaction that declared that space only: the bucket
-- ids it returns go to the runner of that space's migration, in that migration's transaction.
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

-- ---------------------------------------------------------------------------------------------
-- HNSW builds on demand: only for a dimension something uses, 16 dimensions at most
-- ---------------------------------------------------------------------------------------------

-- The serving role may insert a pin (a new space's, a new base's) of any dimension, so "a
-- dimension something uses" bounds nothing on its own: a build of a dimension no index has yet
-- is also refused past `limit` distinct dimensions among `table`'s HNSW indexes (the memories'
-- two slots count one dimension once), unless the session's login is the schema owner (the
-- operator raising it: docs/operations.md, "Vector index dimensions"). Serialised, so two new
-- dimensions' builds cannot both pass the count. The indexes' names are 0004's and 0014's.
CREATE FUNCTION tokensvc.refuse_index_dimension_past_limit(tbl text, dim integer, lim integer) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    pattern text := CASE tbl WHEN 'memories' THEN '^memories_hnsw_(b_)?([1-9][0-9]*)$'
                             ELSE '^chunks_hnsw_()([1-9][0-9]*)$' END;
    dimensions integer;
BEGIN
    IF pg_has_role(session_user, current_user, 'MEMBER') THEN
        RETURN;
    END IF;
    PERFORM pg_advisory_xact_lock(hashtextextended('tokensvc.index_dimensions.' || tbl, 0));
    SELECT count(DISTINCT (regexp_match(c.relname, pattern))[2]) INTO dimensions
    FROM pg_class c
    WHERE c.relnamespace = 'tokensvc'::regnamespace AND c.relkind IN ('i', 'I') AND c.relname ~ pattern
      AND (regexp_match(c.relname, pattern))[2]::integer <> dim;
    IF dimensions >= lim THEN
        RAISE EXCEPTION '% dimensions have HNSW indexes on % already (at most %): the schema owner builds '
            'another', dimensions, tbl, lim USING ERRCODE = '22023';
    END IF;
END $$;
REVOKE ALL ON FUNCTION tokensvc.refuse_index_dimension_past_limit(text, integer, integer) FROM PUBLIC;

-- 0014's partition build, refused (SQLSTATE 22023) for a dimension no memory space is pinned to
-- and no unfinished migration of a space targets, or past 16 dimensions, unless the build was
-- started already (the `vector-indexes` duty finishes what a cancelled migration left).
CREATE OR REPLACE FUNCTION tokensvc.ensure_memory_partition_index(dim integer, slot integer, part integer)
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
    IF to_regclass('tokensvc.' || parent) IS NULL
       AND NOT EXISTS (SELECT 1 FROM tokensvc.memory_spaces s WHERE s.dimension = dim)
       AND NOT EXISTS (SELECT 1 FROM tokensvc.embedding_migrations m
                       WHERE m.agent IS NOT NULL AND m.to_dimension = dim
                         AND m.state IN ('backfilling', 'paused', 'retiring', 'cancelling')) THEN
        RAISE EXCEPTION 'no memory space uses % dimensions', dim USING ERRCODE = '22023';
    END IF;
    IF to_regclass('tokensvc.' || parent) IS NULL THEN
        PERFORM tokensvc.refuse_index_dimension_past_limit('memories', dim, 16);
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

-- 0004's chunk index, refused the same way for a dimension no knowledge base is pinned to and no
-- unfinished migration of a base targets, or past 16 dimensions.
CREATE OR REPLACE FUNCTION tokensvc.ensure_chunk_vector_index(dim integer) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
BEGIN
    IF dim < 1 OR dim > 2000 THEN
        RETURN false;
    END IF;
    IF to_regclass(format('tokensvc.chunks_hnsw_%s', dim)) IS NOT NULL THEN
        RETURN true;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM tokensvc.knowledge_bases k WHERE k.dimension = dim)
       AND NOT EXISTS (SELECT 1 FROM tokensvc.embedding_migrations m
                       WHERE m.kb_ref IS NOT NULL AND m.to_dimension = dim
                         AND m.state IN ('backfilling', 'paused', 'retiring', 'cancelling')) THEN
        RAISE EXCEPTION 'no knowledge base uses % dimensions', dim USING ERRCODE = '22023';
    END IF;
    PERFORM tokensvc.refuse_index_dimension_past_limit('chunks', dim, 16);
    EXECUTE format(
        'CREATE INDEX IF NOT EXISTS chunks_hnsw_%s ON tokensvc.chunks '
        'USING hnsw ((embedding::vector(%s)) vector_ip_ops) WITH (m = 16, ef_construction = 64) '
        'WHERE dimension = %s', dim, dim, dim);
    RETURN true;
END $$;

-- ---------------------------------------------------------------------------------------------
-- Who may execute what
-- ---------------------------------------------------------------------------------------------
DO $$
DECLARE
    f text;
BEGIN
    -- The control plane's (the serving role).
    FOREACH f IN ARRAY ARRAY[
        'start_memory_migration(uuid, text, text, integer, text, text, integer, boolean, bigint, text)',
        'start_knowledge_migration(uuid, text, text, integer, text, text, integer, boolean, text, integer, '
            'integer, bigint, text)',
        'release_started_migration(uuid)',
        'change_migration_state(uuid, text[], text, text)',
        'cancel_knowledge_base_migrations(text, text)']
    LOOP
        EXECUTE format('REVOKE ALL ON FUNCTION tokensvc.%s FROM PUBLIC', f);
        EXECUTE format('GRANT EXECUTE ON FUNCTION tokensvc.%s TO {app_role}', f);
    END LOOP;
    -- The runner's: taken from the serving role (0014, 0015, 0018 granted it the older ones).
    FOREACH f IN ARRAY ARRAY[
        'claim_migration(text, float8, text[], float8, uuid[])',
        'renew_migration(uuid, text, float8)',
        'rewind_migration(uuid, text)',
        'migration_failed(uuid, text, text, integer)',
        'finish_migration(uuid, text[], text, text)',
        'lock_migration_subject(uuid, boolean)',
        'hold_migration(uuid, text)',
        'migration_progress(uuid, text, integer, text, uuid, text, float8)',
        'migration_pending(uuid, text, text, uuid, integer)',
        'migration_store(uuid, text, text[], uuid[], bytea[], vector[])',
        'migration_clear(uuid, text, integer, float8)',
        'cut_over_memory_space(uuid, text)',
        'kb_migration_pending(uuid, text, text, integer)',
        'kb_migration_chunks(uuid, text, text[], bigint[])',
        'kb_migration_store(uuid, text, text[], bigint[], bytea[], integer[], integer[], text[], '
            'integer[], integer[], text[], vector[])',
        'kb_migration_clear(uuid, text, integer, float8)',
        'cut_over_knowledge_base(uuid, text)']
    LOOP
        EXECUTE format('REVOKE ALL ON FUNCTION tokensvc.%s FROM PUBLIC, {app_role}', f);
        EXECUTE format('GRANT EXECUTE ON FUNCTION tokensvc.%s TO {runner_role}', f);
    END LOOP;
END $$;
