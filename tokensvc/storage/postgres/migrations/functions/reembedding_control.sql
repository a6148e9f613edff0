-- Re-embedding, the control plane's side (the serving role): starting, pausing, resuming and
-- cancelling a migration, and the checks every migration function shares.
--
-- Applied after the numbered migrations whenever this file changes (docs/development.md,
-- "Changing a SQL function"): each definition is the current one, in place.


-- Whether the transaction declared migration `m`'s subject: its memory space (namespace and
-- agent), or its knowledge base (the namespace, the base in its roster). A migration's subject
-- never changes once it is recorded, so the check holds for the rest of the transaction.
CREATE OR REPLACE FUNCTION tokensvc.migration_subject_declared(m tokensvc.embedding_migrations) RETURNS boolean
LANGUAGE sql STABLE SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
    SELECT CASE WHEN m.kb_ref IS NOT NULL THEN coalesce(tokensvc.kb_visible(m.namespace, m.kb_ref), false)
                ELSE m.agent IS NOT NULL
                     AND m.namespace IS NOT DISTINCT FROM current_setting('tokensvc.namespace', true)
                     AND m.agent IS NOT DISTINCT FROM current_setting('tokensvc.agent', true) END
$$;
REVOKE ALL ON FUNCTION tokensvc.migration_subject_declared(tokensvc.embedding_migrations) FROM PUBLIC, {app_role}, {runner_role};

-- Whether a migration row may be shown to the serving role: its backfill cursor (a bucket id) is
-- the runner's only.
CREATE OR REPLACE FUNCTION tokensvc.migration_as_served(m tokensvc.embedding_migrations)
RETURNS tokensvc.embedding_migrations LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
BEGIN
    m.cursor_bucket := NULL;
    m.cursor_id := NULL;
    RETURN m;
END $$;
REVOKE ALL ON FUNCTION tokensvc.migration_as_served(tokensvc.embedding_migrations) FROM PUBLIC, {app_role}, {runner_role};

-- The lock order of everything a migration touches: its subject's row (the memory space or the
-- knowledge base) first, then the migration's row, then the subject's data. Writers take the
-- subject row FOR SHARE and never lock the migration row; a runner's batch takes the subject row
-- FOR SHARE before the migration row (this, with exclusive false); a state change (a cancel) and
-- the cutover take it FOR UPDATE first. So no cycle of waits can form between them.
CREATE OR REPLACE FUNCTION tokensvc.lock_migration_subject(migration uuid, exclusive boolean) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    m tokensvc.embedding_migrations;
BEGIN
    SELECT * INTO m FROM tokensvc.embedding_migrations WHERE id = migration;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM set_config('tokensvc.namespace', m.namespace, true);
    IF m.kb_ref IS NOT NULL THEN
        PERFORM set_config('tokensvc.kbs', m.kb_ref, true);
        IF exclusive THEN
            PERFORM 1 FROM tokensvc.knowledge_bases WHERE namespace = m.namespace AND ref = m.kb_ref FOR UPDATE;
        ELSE
            PERFORM 1 FROM tokensvc.knowledge_bases WHERE namespace = m.namespace AND ref = m.kb_ref FOR SHARE;
        END IF;
    ELSE
        PERFORM set_config('tokensvc.agent', m.agent, true);
        IF exclusive THEN
            PERFORM 1 FROM tokensvc.memory_spaces WHERE namespace = m.namespace AND agent = m.agent FOR UPDATE;
        ELSE
            PERFORM 1 FROM tokensvc.memory_spaces WHERE namespace = m.namespace AND agent = m.agent FOR SHARE;
        END IF;
    END IF;
    RETURN true;
END $$;
REVOKE ALL ON FUNCTION tokensvc.lock_migration_subject(uuid,boolean) FROM PUBLIC, {app_role};
GRANT EXECUTE ON FUNCTION tokensvc.lock_migration_subject(uuid,boolean) TO {runner_role};

-- The live memories of a space and their average length: what a migration of it has to embed
-- (counts only, never content).
CREATE OR REPLACE FUNCTION tokensvc.migration_space_size(ns text, ag text, OUT live bigint, OUT average_chars integer)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
    SELECT count(*), coalesce(avg(length(x.content)), 0)::integer FROM tokensvc.memories x
    WHERE x.namespace = ns AND x.agent = ag AND (x.expires_at IS NULL OR x.expires_at > now())
$$;
REVOKE ALL ON FUNCTION tokensvc.migration_space_size(text,text) FROM PUBLIC, {runner_role};
GRANT EXECUTE ON FUNCTION tokensvc.migration_space_size(text,text) TO {app_role};

-- ---------------------------------------------------------------------------------------------
-- The control plane's functions (the serving role: the admin RPCs and a knowledge base's delete)
-- ---------------------------------------------------------------------------------------------

-- A memory space's migration to `target_*`, for the space the transaction declared, from its pin
-- as it is now (read here, not taken from the caller) at `generation_at_start`, held for its start
-- (release_started_migration). No row (nothing recorded) when the space is not at that generation
-- or already has an unfinished migration.
CREATE OR REPLACE FUNCTION tokensvc.start_memory_migration(
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
REVOKE ALL ON FUNCTION tokensvc.start_memory_migration(uuid,text,text,integer,text,text,integer,boolean,bigint,text) FROM PUBLIC, {runner_role};
GRANT EXECUTE ON FUNCTION tokensvc.start_memory_migration(uuid,text,text,integer,text,text,integer,boolean,bigint,text) TO {app_role};

-- A knowledge base's migration, for the base the transaction declared (its namespace and the
-- base in its roster), from its pins as they are now, to a whole target embedder and chunking.
CREATE OR REPLACE FUNCTION tokensvc.start_knowledge_migration(
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
REVOKE ALL ON FUNCTION tokensvc.start_knowledge_migration(uuid,text,text,integer,text,text,integer,boolean,text,integer,integer,bigint,text) FROM PUBLIC, {runner_role};
GRANT EXECUTE ON FUNCTION tokensvc.start_knowledge_migration(uuid,text,text,integer,text,text,integer,boolean,text,integer,integer,bigint,text) TO {app_role};

-- A start's row is leased to no runner until its target's index is built (the start does that
-- after the row exists, since a build is refused for a dimension nothing uses): then this
-- releases it, for a transaction that declared its subject, while it is BACKFILLING. A start
-- that dies before it does leaves the lease to expire (15 minutes).
CREATE OR REPLACE FUNCTION tokensvc.release_started_migration(migration uuid)
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
REVOKE ALL ON FUNCTION tokensvc.release_started_migration(uuid) FROM PUBLIC, {runner_role};
GRANT EXECUTE ON FUNCTION tokensvc.release_started_migration(uuid) TO {app_role};

-- The operator's transitions: cancel (BACKFILLING or PAUSED to CANCELLING, the clean-up walking
-- from the start) and resume (PAUSED to BACKFILLING); the lease is released. For a transaction
-- that declared the migration's subject (checked before anything is locked); the subject row is
-- locked first (lock_migration_subject's order), and the caller's declaration is left as it was (the lock
-- narrows `tokensvc.kbs` to the one base). No row when the migration is in none of `expected`
-- (those the transition allows).
CREATE OR REPLACE FUNCTION tokensvc.change_migration_state(migration uuid, expected text[], new_state text, why text)
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
REVOKE ALL ON FUNCTION tokensvc.change_migration_state(uuid,text[],text,text) FROM PUBLIC, {runner_role};
GRANT EXECUTE ON FUNCTION tokensvc.change_migration_state(uuid,text[],text,text) TO {app_role};

-- A knowledge base's delete ends its unfinished migration (its chunks go with its documents), in
-- the delete's transaction, for the base that transaction declared. Returns how many.
CREATE OR REPLACE FUNCTION tokensvc.cancel_knowledge_base_migrations(ns text, kb text) RETURNS integer
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
REVOKE ALL ON FUNCTION tokensvc.cancel_knowledge_base_migrations(text,text) FROM PUBLIC, {runner_role};
GRANT EXECUTE ON FUNCTION tokensvc.cancel_knowledge_base_migrations(text,text) TO {app_role};
