-- A memory space's clean-up batch (after a cutover or a cancel) takes its locks after its
-- multi-shard statement, not before (issue 19). On Citus a row lock of a reference table is a lock
-- of the whole table, and 0018's batch held two through its read and UPDATE over every shard
-- (6 to 13 s each under the Citus suite's load): the space row FOR SHARE (the caller's
-- lock_migration_subject), which queued the pin of any new space and, behind that pin, every
-- tenant's write; and the migration row FOR UPDATE, which held up every runner's claim and
-- renewal. Writes cancelled as distributed deadlocks around such a batch (three attempts of one
-- Remember) failed the Citus re-embedding test.
--
-- Now: the lease is checked as it is, without a lock; the batch is emptied; then the space row
-- FOR SHARE and the migration row FOR UPDATE are taken (0015's order) and the lease, state and
-- generation checked again. A runner that lost its lease meanwhile raises TK002 there, and its
-- UPDATE rolls back with it: a slot another runner (or a later migration) fills is never emptied.
-- The emptied slot is one no tenant write fills (the old generation's after a cutover: the
-- generation guard refuses such writes; the target's after a cancel: dual writes have stopped), so
-- nothing written between the read and the locks is missed.
--
-- Replaced in place, with the same signature (grants are kept). A replica of the previous release
-- still locks the space row before calling it: correct, as before, only slower on Citus.

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
