-- Long-term memory: the expiry sweep, the row counts by space and by pepper version the
-- statistics and pepper rotation read, and the agents of a namespace a data-subject request lists.
--
-- Applied after the numbered migrations whenever this file changes (docs/development.md,
-- "Changing a SQL function"): each definition is the current one, in place.


-- Up to `lim` expired memories of every bucket, deleted by their key (a ctid is unique per
-- partition only), each found through its partition's primary key.
CREATE OR REPLACE FUNCTION tokensvc.sweep_expired_memories(lim integer) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    deleted integer;
BEGIN
    IF lim IS NULL OR lim < 1 OR lim > 10000 THEN
        RAISE EXCEPTION 'sweep limit must be between 1 and 10000';
    END IF;
    DELETE FROM tokensvc.memories m
    USING (SELECT bucket, id FROM tokensvc.memories WHERE expires_at <= now() LIMIT lim) expired
    WHERE m.bucket = expired.bucket AND m.id = expired.id;
    GET DIAGNOSTICS deleted = ROW_COUNT;
    RETURN deleted;
END $$;
REVOKE ALL ON FUNCTION tokensvc.sweep_expired_memories(integer) FROM PUBLIC, {runner_role};
GRANT EXECUTE ON FUNCTION tokensvc.sweep_expired_memories(integer) TO {app_role};

-- Live memories per pepper version, as `MemoryStatistics.rows_by_pepper_version` promises: an
-- expired row the sweep has not reached yet does not hold an older pepper version in the
-- credential status as if it still had rows.
CREATE OR REPLACE FUNCTION tokensvc.memory_rows_by_pepper_version()
RETURNS TABLE (pepper_version integer, row_count bigint)
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
    SELECT split_part(substr(bucket, 2), '.', 1)::integer, count(*)
    FROM tokensvc.memories
    WHERE expires_at IS NULL OR expires_at > now()
    GROUP BY 1 ORDER BY 1
$$;
REVOKE ALL ON FUNCTION tokensvc.memory_rows_by_pepper_version() FROM PUBLIC, {runner_role};
GRANT EXECUTE ON FUNCTION tokensvc.memory_rows_by_pepper_version() TO {app_role};

-- Live memories per memory space, for the `tokensvc_memories` gauge. Runs as the owner (see the
-- owner's statistics policy on memories); callers get counts per (namespace, agent), never rows.
CREATE OR REPLACE FUNCTION tokensvc.memory_rows_by_space()
RETURNS TABLE (namespace text, agent text, row_count bigint)
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
    SELECT namespace, agent, count(*) FROM tokensvc.memories
    WHERE expires_at IS NULL OR expires_at > now()
    GROUP BY 1, 2 ORDER BY 1, 2
$$;
REVOKE ALL ON FUNCTION tokensvc.memory_rows_by_space() FROM PUBLIC, {runner_role};
GRANT EXECUTE ON FUNCTION tokensvc.memory_rows_by_space() TO {app_role};

-- The memory spaces of a namespace (NULL: of every namespace), in (namespace, agent) order (code
-- points, whatever the database's collation) after a cursor: the agents an end-user may have
-- talked to.
CREATE OR REPLACE FUNCTION tokensvc.memory_space_agents(ns text, after_namespace text, after_agent text, lim integer)
RETURNS TABLE (namespace text, agent text)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
    SELECT s.namespace, s.agent FROM tokensvc.memory_spaces s
    WHERE (ns IS NULL OR s.namespace = ns)
      AND (after_namespace IS NULL
           OR (s.namespace COLLATE "C", s.agent COLLATE "C") > (after_namespace, after_agent))
    ORDER BY s.namespace COLLATE "C", s.agent COLLATE "C" LIMIT least(greatest(lim, 1), 10000)
$$;
REVOKE ALL ON FUNCTION tokensvc.memory_space_agents(text,text,text,integer) FROM PUBLIC, {runner_role};
GRANT EXECUTE ON FUNCTION tokensvc.memory_space_agents(text,text,text,integer) TO {app_role};
