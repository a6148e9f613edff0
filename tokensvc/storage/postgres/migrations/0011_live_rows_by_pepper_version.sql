-- Rows per pepper version count live memories only, as the rows per space (0007) always did and
-- as `MemoryStatistics.rows_by_pepper_version` promises: an expired row the sweep has not reached
-- yet no longer holds an older pepper version in the credential status as if it still had rows.
-- CREATE OR REPLACE keeps the owner and the grants; the SET clause is restated, since replacing
-- a function replaces its settings (0008 pinned this search_path).
CREATE OR REPLACE FUNCTION tokensvc.memory_rows_by_pepper_version()
RETURNS TABLE (pepper_version integer, row_count bigint)
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
    SELECT split_part(substr(bucket, 2), '.', 1)::integer, count(*)
    FROM tokensvc.memories
    WHERE expires_at IS NULL OR expires_at > now()
    GROUP BY 1 ORDER BY 1
$$;
