-- The text ranker's read of a knowledge search (0028, storage/postgres/ranking.py).
--
-- Applied after the numbered migrations whenever this file changes (docs/development.md,
-- "Changing a SQL function"): each definition is the current one, in place.


-- The chunks of the bases `kbs` (each at its generation of `generations`, as a search pairs them)
-- whose text matches `query`, at most `max_rows` per base, with their tsvectors. It runs as the
-- owner, whose only policy on reading chunks is `true` (0028), so the GIN index chunks_text answers
-- the match, which under the serving role's policy it cannot; in its place every base is checked
-- here against the caller's declared tenant with the policy's own predicate (kb_visible): a base
-- the caller may not see gives no row. STRICT: a NULL query (no term to look for) reads nothing.
CREATE OR REPLACE FUNCTION tokensvc.chunks_matching(ns text, kbs text[], generations integer[], query tsquery,
                                                    max_rows integer)
RETURNS TABLE (namespace text, kb_ref text, doc_ref text, generation integer, version bigint,
               chunk_index integer, content_tsv tsvector)
LANGUAGE sql STABLE STRICT SECURITY DEFINER
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
    SELECT c.namespace, c.kb_ref, c.doc_ref, c.generation, c.version, c.chunk_index, c.content_tsv
    FROM unnest(kbs, generations) AS b(kb, gen)
    CROSS JOIN LATERAL (
        SELECT * FROM tokensvc.chunks c
        WHERE c.namespace = ns AND c.kb_ref = b.kb AND c.generation = b.gen AND c.content_tsv @@ query
        LIMIT max_rows
    ) c
    WHERE tokensvc.kb_visible(ns, b.kb)
$$;
REVOKE ALL ON FUNCTION tokensvc.chunks_matching(text,text[],integer[],tsquery,integer) FROM PUBLIC, {runner_role};
GRANT EXECUTE ON FUNCTION tokensvc.chunks_matching(text,text[],integer[],tsquery,integer) TO {app_role};
