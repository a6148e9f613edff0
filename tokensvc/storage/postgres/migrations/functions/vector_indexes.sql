-- HNSW indexes per dimension: the serving role asks the schema owner for one when a memory
-- space or knowledge base pins a new dimension (it owns nothing itself).
--
-- Applied after the numbered migrations whenever this file changes (docs/development.md,
-- "Changing a SQL function"): each definition is the current one, in place.


-- ---------------------------------------------------------------------------------------------
-- HNSW builds on demand: only for a dimension something uses, 16 dimensions at most
-- ---------------------------------------------------------------------------------------------

-- The serving role may insert a pin (a new space's, a new base's) of any dimension, so "a
-- dimension something uses" bounds nothing on its own: a build of a dimension no index has yet
-- is also refused past `limit` distinct dimensions among `table`'s HNSW indexes (the memories'
-- two slots count one dimension once), unless the session's login is the schema owner (the
-- operator raising it: docs/operations.md, "Vector index dimensions"). Serialised, so two new
-- dimensions' builds cannot both pass the count.
CREATE OR REPLACE FUNCTION tokensvc.refuse_index_dimension_past_limit(tbl text, dim integer, lim integer) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    pattern text := CASE tbl WHEN 'memories' THEN '^memories_hnsw_(b_)?([1-9][0-9]*)$'
                             ELSE '^chunks_hnsw_()([1-9][0-9]*)$' END;
    dimensions integer;
BEGIN
    IF pg_has_role(session_user, current_user, 'MEMBER') THEN
        RETURN;
    END IF;
    PERFORM pg_advisory_xact_lock(hashtextextended('tokensvc.index_dimensions.' || tbl, 0));
    SELECT count(DISTINCT (regexp_match(c.relname, pattern))[2]) INTO dimensions
    FROM pg_class c
    WHERE c.relnamespace = 'tokensvc'::regnamespace AND c.relkind IN ('i', 'I') AND c.relname ~ pattern
      AND (regexp_match(c.relname, pattern))[2]::integer <> dim;
    IF dimensions >= lim THEN
        RAISE EXCEPTION '% dimensions have HNSW indexes on % already (at most %): the schema owner builds '
            'another', dimensions, tbl, lim USING ERRCODE = '22023';
    END IF;
END $$;
REVOKE ALL ON FUNCTION tokensvc.refuse_index_dimension_past_limit(text,integer,integer) FROM PUBLIC, {app_role}, {runner_role};

-- HNSW of dimension `dim` on partitioned table `tbl`: one graph per partition, pNNN_hnsw_D,
-- attached to the partitioned index <tbl>_hnsw_D. The owner's helper for ensure_memory_vector_index;
-- nobody else may call it.
CREATE OR REPLACE FUNCTION tokensvc.build_memory_vector_index(tbl text, dim integer) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    part record;
BEGIN
    EXECUTE format(
        'CREATE INDEX %I ON ONLY tokensvc.%I '
        'USING hnsw ((embedding::vector(%s)) vector_ip_ops) WITH (m = 16, ef_construction = 64) '
        'WHERE dimension = %s', tbl || '_hnsw_' || dim, tbl, dim, dim);
    FOR part IN
        SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
        WHERE i.inhparent = format('tokensvc.%I', tbl)::regclass ORDER BY c.relname
    LOOP
        EXECUTE format(
            'CREATE INDEX %I ON tokensvc.%I '
            'USING hnsw ((embedding::vector(%s)) vector_ip_ops) WITH (m = 16, ef_construction = 64) '
            'WHERE dimension = %s', part.relname || '_hnsw_' || dim, part.relname, dim, dim);
        EXECUTE format('ALTER INDEX tokensvc.%I ATTACH PARTITION tokensvc.%I',
                       tbl || '_hnsw_' || dim, part.relname || '_hnsw_' || dim);
    END LOOP;
END $$;
REVOKE ALL ON FUNCTION tokensvc.build_memory_vector_index(text,integer) FROM PUBLIC, {app_role}, {runner_role};

-- The HNSW of a dimension a memory space pins, partition by partition; false when too wide.
CREATE OR REPLACE FUNCTION tokensvc.ensure_memory_vector_index(dim integer) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
BEGIN
    -- HNSW on `vector` supports up to 2,000 dimensions; larger spaces are searched exactly.
    IF dim < 1 OR dim > 2000 THEN
        RETURN false;
    END IF;
    -- Two replicas pinning the same new dimension at once: the second waits, then finds it.
    PERFORM pg_advisory_xact_lock(hashtextextended('tokensvc.memories_hnsw_' || dim, 0));
    IF to_regclass(format('tokensvc.memories_hnsw_%s', dim)) IS NULL THEN
        PERFORM tokensvc.build_memory_vector_index('memories', dim);
    END IF;
    RETURN true;
END $$;
REVOKE ALL ON FUNCTION tokensvc.ensure_memory_vector_index(integer) FROM PUBLIC, {app_role}, {runner_role};

-- One partition's HNSW of (dimension, slot), refused (SQLSTATE 22023) for a dimension no memory space is pinned to
-- and no unfinished migration of a space targets, or past 16 dimensions, unless the build was
-- started already (the `vector-indexes` duty finishes what a cancelled migration left).
CREATE OR REPLACE FUNCTION tokensvc.ensure_memory_partition_index(dim integer, slot integer, part integer)
RETURNS boolean LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    suffix text := CASE WHEN slot = 1 THEN 'b_' ELSE '' END;
    vec text := CASE WHEN slot = 1 THEN 'embedding_b' ELSE 'embedding' END;
    dimcol text := CASE WHEN slot = 1 THEN 'dimension_b' ELSE 'dimension' END;
    parent text := 'memories_hnsw_' || suffix || dim;
    partition text := 'memories_p' || lpad(part::text, 3, '0');
    child text := 'memories_p' || lpad(part::text, 3, '0') || '_hnsw_' || suffix || dim;
BEGIN
    IF dim < 1 OR dim > 2000 OR slot NOT IN (0, 1) OR part < 0 OR part > 999
       OR to_regclass('tokensvc.' || partition) IS NULL THEN
        RETURN false;
    END IF;
    IF to_regclass('tokensvc.' || parent) IS NULL
       AND NOT EXISTS (SELECT 1 FROM tokensvc.memory_spaces s WHERE s.dimension = dim)
       AND NOT EXISTS (SELECT 1 FROM tokensvc.embedding_migrations m
                       WHERE m.agent IS NOT NULL AND m.to_dimension = dim
                         AND m.state IN ('backfilling', 'paused', 'retiring', 'cancelling')) THEN
        RAISE EXCEPTION 'no memory space uses % dimensions', dim USING ERRCODE = '22023';
    END IF;
    IF to_regclass('tokensvc.' || parent) IS NULL THEN
        PERFORM tokensvc.refuse_index_dimension_past_limit('memories', dim, 16);
    END IF;
    PERFORM pg_advisory_xact_lock(hashtextextended('tokensvc.' || parent, 0));
    IF to_regclass('tokensvc.' || parent) IS NULL THEN
        EXECUTE format(
            'CREATE INDEX %I ON ONLY tokensvc.memories '
            'USING hnsw ((%I::vector(%s)) vector_ip_ops) WITH (m = 16, ef_construction = 64) '
            'WHERE %I = %s', parent, vec, dim, dimcol, dim);
    END IF;
    IF to_regclass('tokensvc.' || child) IS NULL THEN
        EXECUTE format(
            'CREATE INDEX %I ON tokensvc.%I '
            'USING hnsw ((%I::vector(%s)) vector_ip_ops) WITH (m = 16, ef_construction = 64) '
            'WHERE %I = %s', child, partition, vec, dim, dimcol, dim);
        EXECUTE format('ALTER INDEX tokensvc.%I ATTACH PARTITION tokensvc.%I', parent, child);
    END IF;
    RETURN true;
END $$;
REVOKE ALL ON FUNCTION tokensvc.ensure_memory_partition_index(integer,integer,integer) FROM PUBLIC, {runner_role};
GRANT EXECUTE ON FUNCTION tokensvc.ensure_memory_partition_index(integer,integer,integer) TO {app_role};

-- Whether (slot, dimension) is indexed on every partition (or needs no HNSW index: too wide).
CREATE OR REPLACE FUNCTION tokensvc.memory_vector_index_ready(dim integer, slot integer) RETURNS boolean
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
    SELECT dim > 2000 OR coalesce((SELECT i.indisvalid FROM pg_index i WHERE i.indexrelid = to_regclass(
        'tokensvc.memories_hnsw_' || CASE WHEN slot = 1 THEN 'b_' ELSE '' END || dim)), false)
$$;
REVOKE ALL ON FUNCTION tokensvc.memory_vector_index_ready(integer,integer) FROM PUBLIC, {runner_role};
GRANT EXECUTE ON FUNCTION tokensvc.memory_vector_index_ready(integer,integer) TO {app_role};

-- The chunks' HNSW of a dimension, refused the same way for a dimension no knowledge base is pinned to and no
-- unfinished migration of a base targets, or past 16 dimensions.
CREATE OR REPLACE FUNCTION tokensvc.ensure_chunk_vector_index(dim integer) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
BEGIN
    IF dim < 1 OR dim > 2000 THEN
        RETURN false;
    END IF;
    IF to_regclass(format('tokensvc.chunks_hnsw_%s', dim)) IS NOT NULL THEN
        RETURN true;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM tokensvc.knowledge_bases k WHERE k.dimension = dim)
       AND NOT EXISTS (SELECT 1 FROM tokensvc.embedding_migrations m
                       WHERE m.kb_ref IS NOT NULL AND m.to_dimension = dim
                         AND m.state IN ('backfilling', 'paused', 'retiring', 'cancelling')) THEN
        RAISE EXCEPTION 'no knowledge base uses % dimensions', dim USING ERRCODE = '22023';
    END IF;
    PERFORM tokensvc.refuse_index_dimension_past_limit('chunks', dim, 16);
    EXECUTE format(
        'CREATE INDEX IF NOT EXISTS chunks_hnsw_%s ON tokensvc.chunks '
        'USING hnsw ((embedding::vector(%s)) vector_ip_ops) WITH (m = 16, ef_construction = 64) '
        'WHERE dimension = %s', dim, dim, dim);
    RETURN true;
END $$;
REVOKE ALL ON FUNCTION tokensvc.ensure_chunk_vector_index(integer) FROM PUBLIC, {runner_role};
GRANT EXECUTE ON FUNCTION tokensvc.ensure_chunk_vector_index(integer) TO {app_role};
