-- The expired-memory sweep moves behind a SECURITY DEFINER function. The policies of 0003 let any
-- serving transaction that declared itself a sweep read other tenants' expired rows (and learn
-- their bucket ids); now only the owner, inside this function, can see or delete expired rows.
DROP POLICY memories_sweep ON tokensvc.memories;
DROP POLICY memories_sweep_read ON tokensvc.memories;
DO $$
BEGIN
    EXECUTE format(
        'CREATE POLICY memories_owner_sweep ON tokensvc.memories FOR DELETE TO %I '
        'USING (expires_at IS NOT NULL AND expires_at <= now())', current_user);
END $$;

CREATE FUNCTION tokensvc.sweep_expired_memories(lim integer) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    deleted integer;
BEGIN
    IF lim IS NULL OR lim < 1 OR lim > 10000 THEN
        RAISE EXCEPTION 'sweep limit must be between 1 and 10000';
    END IF;
    DELETE FROM tokensvc.memories
    WHERE ctid = ANY (ARRAY(SELECT ctid FROM tokensvc.memories WHERE expires_at <= now() LIMIT lim));
    GET DIAGNOSTICS deleted = ROW_COUNT;
    RETURN deleted;
END $$;
REVOKE ALL ON FUNCTION tokensvc.sweep_expired_memories(integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION tokensvc.sweep_expired_memories(integer) TO {app_role};

-- Every SECURITY DEFINER function resolves names in pg_catalog first and pg_temp last, so no
-- temporary object of a caller can stand in for one of ours.
ALTER FUNCTION tokensvc.ensure_memory_vector_index(integer) SET search_path = pg_catalog, tokensvc, public, pg_temp;
ALTER FUNCTION tokensvc.ensure_chunk_vector_index(integer) SET search_path = pg_catalog, tokensvc, public, pg_temp;
ALTER FUNCTION tokensvc.memory_rows_by_pepper_version() SET search_path = pg_catalog, tokensvc, public, pg_temp;
ALTER FUNCTION tokensvc.memory_rows_by_space() SET search_path = pg_catalog, tokensvc, public, pg_temp;
