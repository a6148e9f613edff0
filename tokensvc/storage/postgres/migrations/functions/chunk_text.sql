-- The text ranker's read of a knowledge search (0028, storage/postgres/ranking.py).
--
-- Applied after the numbered migrations whenever this file changes (docs/development.md,
-- "Changing a SQL function"): each definition is the current one, in place.


-- The chunks of the bases `kbs` (each at its generation of `generations`, as a search pairs them)
-- whose text matches `query`, at most `max_rows` per base, with their tsvectors. It runs as the
-- owner, whose only policy on reading chunks is `true` (0028), so the GIN index chunks_text can
-- answer the match, which under the serving role's policy it cannot; in its place every base is
-- checked here against the caller's declared tenant with the policy's own predicate (kb_visible):
-- a base the caller may not see gives no row. STRICT: a NULL query (no term to look for) reads
-- nothing.
--
-- Each base's read is planned for its own values (EXECUTE): the index is one for every base, so
-- a term common in the database costs its whole posting list, and for a small base reading its
-- chunks by chunks_kb_generation is the cheaper plan. Planned once for any base (an SQL
-- function's cached plan), a 2,500-chunk base beside a 100,000-chunk one took 92 ms for a common
-- term through the index, where reading the base takes a few.
CREATE OR REPLACE FUNCTION tokensvc.chunks_matching(ns text, kbs text[], generations integer[], query tsquery,
                                                    max_rows integer)
RETURNS TABLE (namespace text, kb_ref text, doc_ref text, generation integer, version bigint,
               chunk_index integer, content_tsv tsvector)
LANGUAGE plpgsql STABLE STRICT SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    FOR i IN 1 .. coalesce(least(cardinality(kbs), cardinality(generations)), 0) LOOP
        -- Unknown (no tenant declared) is no. Each row read is checked too, with the policy's own
        -- predicate on its columns: the arguments' comparison takes the caller's collation (a
        -- nondeterministic one could make another tenant's name equal to the declared one), a
        -- column's cannot be changed.
        CONTINUE WHEN NOT coalesce(tokensvc.kb_visible(ns, kbs[i]), false);
        RETURN QUERY EXECUTE
            'SELECT c.namespace, c.kb_ref, c.doc_ref, c.generation, c.version, c.chunk_index, c.content_tsv '
            'FROM tokensvc.chunks c WHERE c.namespace = $1 AND c.kb_ref = $2 AND c.generation = $3 '
            'AND c.content_tsv @@ $4 AND tokensvc.kb_visible(c.namespace, c.kb_ref) LIMIT $5'
            USING ns, kbs[i], generations[i], query, max_rows;
    END LOOP;
END $$;
REVOKE ALL ON FUNCTION tokensvc.chunks_matching(text,text[],integer[],tsquery,integer) FROM PUBLIC, {runner_role};
GRANT EXECUTE ON FUNCTION tokensvc.chunks_matching(text,text[],integer[],tsquery,integer) TO {app_role};
