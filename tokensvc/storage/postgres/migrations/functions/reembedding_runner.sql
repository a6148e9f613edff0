-- Re-embedding, the runner's side: claiming a migration, holding and renewing its lease,
-- recording progress and failures, finishing it. Every call names the lease it holds.
--
-- Applied after the numbered migrations whenever this file changes (docs/development.md,
-- "Changing a SQL function"): each definition is the current one, in place.


-- Each runner function acts for one migration only: it takes the migration's id and the runner's
-- name, refuses (raises) unless the migration is in the state that work belongs to and the runner
-- holds its lease, and derives the space, the slot and the dimension from the migration's row, so
-- nothing a caller passes can point it at another space or at the slot a space reads.
CREATE OR REPLACE FUNCTION tokensvc.leased_migration(migration uuid, runner text, wanted text[])
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
REVOKE ALL ON FUNCTION tokensvc.leased_migration(uuid,text,text[]) FROM PUBLIC, {app_role}, {runner_role};

-- The same for a knowledge base's migration: it acts for one migration whose lease the caller
-- holds, in the state the work belongs to, and takes the base, the generation and the dimension
-- from the migration's row. They declare that base as the
-- transaction's tenant, so the tables' own row-level security confines them to it.
CREATE OR REPLACE FUNCTION tokensvc.leased_knowledge_migration(migration uuid, runner text, wanted text[])
RETURNS tokensvc.embedding_migrations LANGUAGE plpgsql
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    m tokensvc.embedding_migrations := tokensvc.leased_migration(migration, runner, wanted);
BEGIN
    IF m.kb_ref IS NULL THEN
        RAISE EXCEPTION 'migration % is not of a knowledge base', migration USING ERRCODE = 'TK002';
    END IF;
    PERFORM set_config('tokensvc.namespace', m.namespace, true);
    PERFORM set_config('tokensvc.kbs', m.kb_ref, true);
    RETURN m;
END $$;
REVOKE ALL ON FUNCTION tokensvc.leased_knowledge_migration(uuid,text,text[]) FROM PUBLIC, {app_role}, {runner_role};

-- ---------------------------------------------------------------------------------------------
-- The runner's functions ({runner_role} only)
-- ---------------------------------------------------------------------------------------------

-- The lease of the oldest runnable migration whose lease is free, expired or `runner`'s own, not
-- one of `busy`; a BACKFILLING one only when its target embedder is among `embedders`, a RETIRING
-- one `retire_after` seconds after its cutover.
CREATE OR REPLACE FUNCTION tokensvc.claim_migration(runner text, lease_seconds float8, embedders text[],
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
REVOKE ALL ON FUNCTION tokensvc.claim_migration(text,double precision,text[],double precision,uuid[]) FROM PUBLIC, {app_role};
GRANT EXECUTE ON FUNCTION tokensvc.claim_migration(text,double precision,text[],double precision,uuid[]) TO {runner_role};

-- Extends `runner`'s lease of a runnable migration (an expired one too, when nobody took it).
CREATE OR REPLACE FUNCTION tokensvc.renew_migration(migration uuid, runner text, lease_seconds float8) RETURNS boolean
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
REVOKE ALL ON FUNCTION tokensvc.renew_migration(uuid,text,double precision) FROM PUBLIC, {app_role};
GRANT EXECUTE ON FUNCTION tokensvc.renew_migration(uuid,text,double precision) TO {runner_role};

-- On Citus, in each of the runner's transactions a row is locked and written by one role only, and
-- no UPDATE of a distributed or reference table calls a volatile function (statement_timestamp(),
-- never clock_timestamp()). Citus opens its worker connections per role: a row locked by one role
-- and locked or updated again by another is a deadlock Citus cancels. So a batch takes its locks
-- and records its progress through owner functions only (hold_migration, migration_progress), in
-- the lock order of lock_migration_subject: the subject row FOR SHARE, then the migration row FOR
-- UPDATE, then the subject's data. The runner's transactions declare the subject's tenant
-- themselves (the service's `declare`, which reaches the workers); the set_config calls in
-- leased_migration and leased_knowledge_migration set the same values on the coordinator.

-- In a batch's transaction: the subject row FOR SHARE (lock_migration_subject), then the migration
-- row FOR UPDATE when `runner` holds the BACKFILLING migration's lease. Returns whether it does.
CREATE OR REPLACE FUNCTION tokensvc.hold_migration(migration uuid, runner text) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
BEGIN
    IF runner IS NULL OR NOT tokensvc.lock_migration_subject(migration, false) THEN
        RETURN false;
    END IF;
    PERFORM 1 FROM tokensvc.embedding_migrations
    WHERE id = migration AND state = 'backfilling' AND lease_owner = runner
      AND lease_until >= statement_timestamp()
    FOR UPDATE;
    RETURN FOUND;
END $$;
REVOKE ALL ON FUNCTION tokensvc.hold_migration(uuid,text) FROM PUBLIC, {app_role};
GRANT EXECUTE ON FUNCTION tokensvc.hold_migration(uuid,text) TO {runner_role};

-- The backfill's cursor back to the start, for the runner holding the lease.
CREATE OR REPLACE FUNCTION tokensvc.rewind_migration(migration uuid, runner text) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
BEGIN
    UPDATE tokensvc.embedding_migrations
    SET cursor_bucket = NULL, cursor_id = NULL, cursor_document = NULL, updated_at = statement_timestamp()
    WHERE id = migration AND lease_owner = runner AND lease_until >= statement_timestamp();
    RETURN FOUND;
END $$;
REVOKE ALL ON FUNCTION tokensvc.rewind_migration(uuid,text) FROM PUBLIC, {app_role};
GRANT EXECUTE ON FUNCTION tokensvc.rewind_migration(uuid,text) TO {runner_role};

-- A batch's progress, in the transaction that held the migration (hold_migration): `written`
-- more rows done, the cursor moved to the batch's last memory or document (NULL: unchanged), the
-- lease renewed. Returns the migration's row, none when `runner` no longer holds it.
CREATE OR REPLACE FUNCTION tokensvc.migration_progress(migration uuid, runner text, written integer,
                                            after_bucket text, after_id uuid, after_document text,
                                            lease_seconds float8)
RETURNS SETOF tokensvc.embedding_migrations LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
BEGIN
    IF written IS NULL OR written < 0 OR lease_seconds IS NULL OR lease_seconds <= 0
       OR (after_bucket IS NULL) <> (after_id IS NULL) THEN
        RAISE EXCEPTION 'a batch''s progress: rows written, a whole cursor and a lease';
    END IF;
    RETURN QUERY
    UPDATE tokensvc.embedding_migrations
    SET rows_done = rows_done + written, rows_total = greatest(rows_total, rows_done + written),
        failures = 0, reason = '', cursor_bucket = coalesce(after_bucket, cursor_bucket),
        cursor_id = coalesce(after_id, cursor_id), cursor_document = coalesce(after_document, cursor_document),
        lease_until = statement_timestamp() + make_interval(secs => lease_seconds),
        updated_at = statement_timestamp()
    WHERE id = migration AND state = 'backfilling' AND lease_owner = runner
    RETURNING *;
END $$;
REVOKE ALL ON FUNCTION tokensvc.migration_progress(uuid,text,integer,text,uuid,text,double precision) FROM PUBLIC, {app_role};
GRANT EXECUTE ON FUNCTION tokensvc.migration_progress(uuid,text,integer,text,uuid,text,double precision) TO {runner_role};

-- A consecutive embedder failure of the runner holding the lease; at `pause_after` of them the
-- migration pauses (its lease released). Not a CASE around a volatile function: Citus refuses one.
CREATE OR REPLACE FUNCTION tokensvc.migration_failed(migration uuid, runner text, why text, pause_after integer)
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
REVOKE ALL ON FUNCTION tokensvc.migration_failed(uuid,text,text,integer) FROM PUBLIC, {app_role};
GRANT EXECUTE ON FUNCTION tokensvc.migration_failed(uuid,text,text,integer) TO {runner_role};

-- The runner's transitions: a clean-up's end (RETIRING to SUCCEEDED; CANCELLING, or a migration
-- whose subject is gone, to CANCELLED) and a pause (BACKFILLING to PAUSED); the lease is released.
-- The subject row is locked first (lock_migration_subject's order).
CREATE OR REPLACE FUNCTION tokensvc.finish_migration(migration uuid, expected text[], new_state text, why text)
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
REVOKE ALL ON FUNCTION tokensvc.finish_migration(uuid,text[],text,text) FROM PUBLIC, {app_role};
GRANT EXECUTE ON FUNCTION tokensvc.finish_migration(uuid,text[],text,text) TO {runner_role};
