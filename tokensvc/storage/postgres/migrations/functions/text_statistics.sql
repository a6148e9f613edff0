-- A knowledge base's BM25 statistics (0027): counted in the background by the runners, read by
-- every text search of the base.
--
-- Applied after the numbered migrations whenever this file changes (docs/development.md,
-- "Changing a SQL function"): each definition is the current one, in place.


-- Counts the statistics of the base's current generation when they are missing, or when its chunk
-- count moved by `drift` (a share) or more since they were counted: the chunk count, the mean
-- number of distinct lexemes per chunk, and every lexeme held by at least `min_share` of the
-- chunks (at least `min_chunks`) with its chunk count. A base of fewer than `min_base` chunks keeps
-- none (its searches count from its rows, which is cheap there). The rows of other generations go:
-- a search reads the current one. Returns whether it counted. One counter per base at a time
-- (another one's count is as good: this returns false at once).
CREATE OR REPLACE FUNCTION tokensvc.count_text_statistics(ns text, kb text, min_base integer,
                                                          min_share float8, min_chunks integer, drift float8)
RETURNS boolean LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    current_generation integer;
    now_chunks bigint;
    counted_chunks bigint;
    listed integer;
BEGIN
    -- Only a base of the declared tenant: the owner reads every tenant's chunks (0028), so without
    -- this the count of another tenant's base would show in what this returns or raises.
    IF NOT coalesce(tokensvc.kb_visible(ns, kb), false) THEN
        RETURN false;
    END IF;
    IF NOT pg_try_advisory_xact_lock(hashtextextended('tokensvc.text_statistics/' || ns || '/' || kb, 0)) THEN
        RETURN false;
    END IF;
    SELECT b.generation INTO current_generation FROM tokensvc.knowledge_bases b
    WHERE b.namespace = ns AND b.ref = kb;
    IF current_generation IS NULL THEN
        RETURN false;  -- deleted meanwhile
    END IF;
    SELECT count(*) INTO now_chunks FROM tokensvc.chunks c
    WHERE c.namespace = ns AND c.kb_ref = kb AND c.generation = current_generation;
    SELECT s.chunks INTO counted_chunks FROM tokensvc.text_statistics s
    WHERE s.namespace = ns AND s.kb_ref = kb AND s.generation = current_generation;
    IF now_chunks >= min_base AND counted_chunks IS NOT NULL
       AND abs(now_chunks - counted_chunks) < drift * counted_chunks THEN
        RETURN false;
    END IF;
    DELETE FROM tokensvc.text_statistics s WHERE s.namespace = ns AND s.kb_ref = kb;
    IF now_chunks < min_base THEN
        RETURN false;
    END IF;
    listed := greatest(min_chunks, ceil(min_share * now_chunks)::integer);
    -- The namespace written is the chunks' own column, grouped by: on Citus that makes each
    -- INSERT ... SELECT run on the shard that holds the base (a constant there has the coordinator
    -- pull the rows and COPY them back, which row-level security refuses).
    INSERT INTO tokensvc.text_statistics (namespace, kb_ref, generation, chunks, avg_length, min_chunks)
    SELECT c.namespace, kb, current_generation, count(*), coalesce(avg(length(c.content_tsv)), 0), listed
    FROM tokensvc.chunks c
    WHERE c.namespace = ns AND c.kb_ref = kb AND c.generation = current_generation
    GROUP BY c.namespace;
    -- unnest(tsvector) gives each lexeme of a chunk once: count(*) is its chunk count.
    INSERT INTO tokensvc.common_lexemes (namespace, kb_ref, generation, lexeme, chunks)
    SELECT c.namespace, kb, current_generation, u.lexeme, count(*)
    FROM tokensvc.chunks c CROSS JOIN LATERAL unnest(c.content_tsv) u
    WHERE c.namespace = ns AND c.kb_ref = kb AND c.generation = current_generation
    GROUP BY c.namespace, u.lexeme HAVING count(*) >= listed;
    RETURN true;
END $$;
REVOKE ALL ON FUNCTION tokensvc.count_text_statistics(text,text,integer,float8,integer,float8) FROM PUBLIC, {app_role};
GRANT EXECUTE ON FUNCTION tokensvc.count_text_statistics(text,text,integer,float8,integer,float8) TO {runner_role};
