-- Live memories per memory space, for the `tokensvc_memories` gauge. Runs as the owner (see the
-- statistics policy in 0006); callers get counts per (namespace, agent), never rows.
CREATE FUNCTION tokensvc.memory_rows_by_space()
RETURNS TABLE (namespace text, agent text, row_count bigint)
LANGUAGE sql SECURITY DEFINER SET search_path = tokensvc, public AS $$
    SELECT namespace, agent, count(*) FROM tokensvc.memories
    WHERE expires_at IS NULL OR expires_at > now()
    GROUP BY 1, 2 ORDER BY 1, 2
$$;
REVOKE ALL ON FUNCTION tokensvc.memory_rows_by_space() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION tokensvc.memory_rows_by_space() TO {app_role};
