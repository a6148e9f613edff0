-- Background ingestion's queue (migration 0024): what a runner claims across namespaces, and the
-- queue as the metrics read it. Everything else a runner does to an ingestion it does as the
-- serving role under the ingestion's tenant, each write fenced by the lease (storage/postgres/
-- ingestion.py).
--
-- Applied after the numbered migrations whenever this file changes (docs/development.md,
-- "Changing a SQL function"): each definition is the current one, in place.


-- Takes the lease of an unfinished ingestion whose lease is free, expired or `runner`'s own,
-- other than those in `busy`: of the namespace with the fewest ingestions leased now, the oldest
-- first, so one namespace's queue does not hold the others back. A candidate is read first and
-- taken by a conditional UPDATE of its row alone (a runner that took it in between wins, the next
-- candidate is tried): no SKIP LOCKED over the whole table, which Citus cannot route.
-- SECURITY DEFINER: the queue is every namespace's; the owner is not bound by the tables'
-- row-level security (enabled, not forced), the serving role is.
CREATE OR REPLACE FUNCTION tokensvc.claim_ingestion(runner text, lease_seconds float8, busy uuid[])
RETURNS SETOF tokensvc.ingestions LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    candidate record;
BEGIN
    IF runner IS NULL OR length(runner) NOT BETWEEN 1 AND 256 OR lease_seconds IS NULL
       OR NOT lease_seconds BETWEEN 0.001 AND 3600 THEN
        RAISE EXCEPTION 'a claim needs a runner and a lease of up to an hour' USING ERRCODE = '22023';
    END IF;
    FOR candidate IN
        WITH unfinished AS (
            SELECT i.namespace, i.id, i.created_at, i.lease_owner, i.lease_until
            FROM tokensvc.ingestions i WHERE i.state <> 'failed'),
        leased AS (
            SELECT u.namespace, count(*) FILTER (WHERE u.lease_until >= statement_timestamp()) AS n
            FROM unfinished u GROUP BY u.namespace)
        SELECT u.namespace, u.id FROM unfinished u JOIN leased l ON l.namespace = u.namespace
        WHERE (u.lease_owner IS NULL OR u.lease_owner = runner OR u.lease_until < statement_timestamp())
          AND u.id <> ALL (coalesce(busy, '{}'))
        ORDER BY l.n, u.created_at, u.id LIMIT 8
    LOOP
        RETURN QUERY
        UPDATE tokensvc.ingestions i
        SET lease_owner = runner, lease_until = statement_timestamp() + make_interval(secs => lease_seconds)
        WHERE i.namespace = candidate.namespace AND i.id = candidate.id AND i.state <> 'failed'
          AND (i.lease_owner IS NULL OR i.lease_owner = runner OR i.lease_until < statement_timestamp())
        RETURNING i.*;
        IF FOUND THEN
            RETURN;
        END IF;
    END LOOP;
END $$;
REVOKE ALL ON FUNCTION tokensvc.claim_ingestion(text,double precision,uuid[]) FROM PUBLIC, {runner_role};
GRANT EXECUTE ON FUNCTION tokensvc.claim_ingestion(text,double precision,uuid[]) TO {app_role};

-- The queue across every namespace: unfinished ingestions waiting and leased now, failed ones,
-- and the age of the oldest unfinished one in seconds (0: none), for the metrics and the
-- stuck-queue alert. It reveals counts only.
CREATE OR REPLACE FUNCTION tokensvc.ingestion_queue(OUT pending bigint, OUT processing bigint,
                                                    OUT failed bigint, OUT oldest_seconds float8)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
    SELECT count(*) FILTER (WHERE i.state <> 'failed' AND NOT i.leased),
           count(*) FILTER (WHERE i.state <> 'failed' AND i.leased),
           count(*) FILTER (WHERE i.state = 'failed'),
           coalesce(extract(epoch FROM statement_timestamp()
                                       - min(i.created_at) FILTER (WHERE i.state <> 'failed')), 0)::float8
    FROM (SELECT state, created_at, coalesce(lease_until >= statement_timestamp(), false) AS leased
          FROM tokensvc.ingestions) i
$$;
REVOKE ALL ON FUNCTION tokensvc.ingestion_queue() FROM PUBLIC, {runner_role};
GRANT EXECUTE ON FUNCTION tokensvc.ingestion_queue() TO {app_role};
