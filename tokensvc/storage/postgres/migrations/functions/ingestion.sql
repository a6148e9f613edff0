-- Background ingestion (migration 0024): what the runner role does to a queued document version,
-- each step a function of the owner's that checks the runner's lease on the ingestion row, and
-- the queue as the metrics read it.
--
-- The runner role reads no tenant table itself (issue 35, F12): it claims, leases, reads the bytes
-- and the base's pins, stages chunks, stores vectors and finishes a version only through these
-- functions, and only for an ingestion whose lease it holds. The serving role queues uploads through
-- `queue_ingestion` and `relabel_ingestion`: it chooses an ingestion's identity (namespace, base,
-- document, version, type, hash, size, metadata), never its lease, state or progress, so a lease
-- these functions check is the runner's own; what they write goes to the ingestion's own
-- document, which the serving role may write anyway. Every function but the claims runs in a transaction that
-- declared the ingestion's namespace (the runner's `tenant_transaction`): row-level security
-- holds the owner to it on the bytes, the staged chunks, the documents and the chunks.
--
-- Applied after the numbered migrations whenever this file changes (docs/development.md,
-- "Changing a SQL function"): each definition is the current one, in place.


-- Queues an upload (the serving role's, in its transaction under the document's advisory lock):
-- the version's row, PENDING and unleased, with its bytes, replacing the document's queued or
-- failed one (`replaces`). Row-level security holds it to the caller's declared namespace and
-- bases. The serving role writes no ingestion column itself: not a lease, state or progress
-- (and on Citus column grants do not reach the shards).
CREATE OR REPLACE FUNCTION tokensvc.queue_ingestion(
    ns text, kb text, doc text, replaces uuid, job uuid, new_version bigint, media_type text, sha bytea,
    size bigint, labels jsonb, bytes bytea)
RETURNS SETOF tokensvc.ingestions LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
BEGIN
    IF new_version IS NULL OR new_version < 1 OR job IS NULL OR bytes IS NULL THEN
        RAISE EXCEPTION 'an upload needs an id, a version and its bytes' USING ERRCODE = '22023';
    END IF;
    IF NOT tokensvc.kb_visible(ns, kb) THEN
        RAISE EXCEPTION 'the knowledge base is outside the declared tenant' USING ERRCODE = '42501';
    END IF;
    IF replaces IS NOT NULL THEN
        DELETE FROM tokensvc.ingestions i WHERE i.namespace = ns AND i.id = replaces AND i.kb_ref = kb
          AND i.doc_ref = doc;
    END IF;
    RETURN QUERY
    INSERT INTO tokensvc.ingestions (namespace, id, kb_ref, doc_ref, version, content_type, content_sha256,
                                     size_bytes, metadata)
    VALUES (ns, job, kb, doc, new_version, media_type, sha, size, coalesce(labels, '{}'::jsonb))
    RETURNING *;
    INSERT INTO tokensvc.ingestion_content (namespace, ingestion, kb_ref, content) VALUES (ns, job, kb, bytes);
END $$;
REVOKE ALL ON FUNCTION tokensvc.queue_ingestion(text,text,text,uuid,uuid,bigint,text,bytea,bigint,jsonb,bytea) FROM PUBLIC, {runner_role};
GRANT EXECUTE ON FUNCTION tokensvc.queue_ingestion(text,text,text,uuid,uuid,bigint,text,bytea,bigint,jsonb,bytea) TO {app_role};

-- New metadata for a queued version (the same bytes uploaded again), within the caller's declared
-- namespace and bases.
CREATE OR REPLACE FUNCTION tokensvc.relabel_ingestion(ns text, job uuid, labels jsonb)
RETURNS SETOF tokensvc.ingestions LANGUAGE sql SECURITY DEFINER
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
    UPDATE tokensvc.ingestions i SET metadata = coalesce(labels, '{}'::jsonb), updated_at = statement_timestamp()
    WHERE i.namespace = ns AND i.id = job AND tokensvc.kb_visible(i.namespace, i.kb_ref)
    RETURNING *
$$;
REVOKE ALL ON FUNCTION tokensvc.relabel_ingestion(text,uuid,jsonb) FROM PUBLIC, {runner_role};
GRANT EXECUTE ON FUNCTION tokensvc.relabel_ingestion(text,uuid,jsonb) TO {app_role};

-- The ingestion `job` of `ns`, locked, when `runner` holds its unexpired lease and it has not
-- failed; else SQLSTATE TI001 (the caller has lost it: taken over, replaced, deleted, failed).
CREATE OR REPLACE FUNCTION tokensvc.held_ingestion(ns text, job uuid, runner text)
RETURNS tokensvc.ingestions LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    held tokensvc.ingestions;
BEGIN
    SELECT * INTO held FROM tokensvc.ingestions i
    WHERE i.namespace = ns AND i.id = job AND i.lease_owner = runner
      AND i.lease_until >= statement_timestamp() AND i.state <> 'failed'
    FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'the ingestion''s lease is not held' USING ERRCODE = 'TI001';
    END IF;
    RETURN held;
END $$;
REVOKE ALL ON FUNCTION tokensvc.held_ingestion(text,uuid,text) FROM PUBLIC, {app_role}, {runner_role};

-- Takes the lease of an unfinished ingestion whose lease is free, expired or `runner`'s own,
-- other than those in `busy`: of the namespace with the fewest ingestions leased now, the oldest
-- first, so one namespace's queue does not hold the others back. A candidate is read first and
-- taken by a conditional UPDATE of its row alone (a runner that took it in between wins, the next
-- candidate is tried): no SKIP LOCKED over the whole table, which Citus cannot route. The owner's
-- policies (0024) show it every namespace's queue.
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
REVOKE ALL ON FUNCTION tokensvc.claim_ingestion(text,double precision,uuid[]) FROM PUBLIC, {app_role};
GRANT EXECUTE ON FUNCTION tokensvc.claim_ingestion(text,double precision,uuid[]) TO {runner_role};

-- Takes the lease of this ingestion when it is free, expired or `runner`'s own (an upload that
-- waits for its version has the runner of its replica work on it at once); nothing when another
-- runner holds it or it failed.
CREATE OR REPLACE FUNCTION tokensvc.claim_this_ingestion(ns text, job uuid, runner text, lease_seconds float8)
RETURNS SETOF tokensvc.ingestions LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
BEGIN
    IF runner IS NULL OR length(runner) NOT BETWEEN 1 AND 256 OR lease_seconds IS NULL
       OR NOT lease_seconds BETWEEN 0.001 AND 3600 THEN
        RAISE EXCEPTION 'a claim needs a runner and a lease of up to an hour' USING ERRCODE = '22023';
    END IF;
    RETURN QUERY
    UPDATE tokensvc.ingestions i
    SET lease_owner = runner, lease_until = statement_timestamp() + make_interval(secs => lease_seconds)
    WHERE i.namespace = ns AND i.id = job AND i.state <> 'failed'
      AND (i.lease_owner IS NULL OR i.lease_owner = runner OR i.lease_until < statement_timestamp())
    RETURNING i.*;
END $$;
REVOKE ALL ON FUNCTION tokensvc.claim_this_ingestion(text,uuid,text,double precision) FROM PUBLIC, {app_role};
GRANT EXECUTE ON FUNCTION tokensvc.claim_this_ingestion(text,uuid,text,double precision) TO {runner_role};

-- Extends `runner`'s lease (an expired one too, when nobody took it since).
CREATE OR REPLACE FUNCTION tokensvc.renew_ingestion(ns text, job uuid, runner text, lease_seconds float8)
RETURNS boolean LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
BEGIN
    IF lease_seconds IS NULL OR NOT lease_seconds BETWEEN 0.001 AND 3600 THEN
        RAISE EXCEPTION 'a lease of up to an hour' USING ERRCODE = '22023';
    END IF;
    UPDATE tokensvc.ingestions i
    SET lease_until = statement_timestamp() + make_interval(secs => lease_seconds)
    WHERE i.namespace = ns AND i.id = job AND i.lease_owner = runner AND i.state <> 'failed';
    RETURN FOUND;
END $$;
REVOKE ALL ON FUNCTION tokensvc.renew_ingestion(text,uuid,text,double precision) FROM PUBLIC, {app_role};
GRANT EXECUTE ON FUNCTION tokensvc.renew_ingestion(text,uuid,text,double precision) TO {runner_role};

-- The ingestion as stored now (nothing once it ended: finished, replaced, deleted): the runner
-- reads the queue's rows as the re-embedding runner reads its migrations', never the bytes, the
-- staged chunks or a document without a lease.
CREATE OR REPLACE FUNCTION tokensvc.runner_ingestion(ns text, job uuid)
RETURNS SETOF tokensvc.ingestions LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
    SELECT * FROM tokensvc.ingestions i WHERE i.namespace = ns AND i.id = job
$$;
REVOKE ALL ON FUNCTION tokensvc.runner_ingestion(text,uuid) FROM PUBLIC, {app_role};
GRANT EXECUTE ON FUNCTION tokensvc.runner_ingestion(text,uuid) TO {runner_role};

-- Counts a consecutive failure with `reason`; at `pause_after` of them the ingestion is FAILED,
-- its lease released and its staged chunks gone. Nothing when the lease is not held.
CREATE OR REPLACE FUNCTION tokensvc.ingestion_failed(ns text, job uuid, runner text, why text, pause_after integer)
RETURNS SETOF tokensvc.ingestions LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    held tokensvc.ingestions;
    ended boolean;
BEGIN
    BEGIN
        held := tokensvc.held_ingestion(ns, job, runner);
    EXCEPTION WHEN SQLSTATE 'TI001' THEN
        RETURN;
    END;
    ended := held.failures + 1 >= greatest(pause_after, 1);
    IF ended THEN
        DELETE FROM tokensvc.ingestion_chunks c WHERE c.namespace = ns AND c.ingestion = job;
    END IF;
    RETURN QUERY
    UPDATE tokensvc.ingestions i
    SET failures = i.failures + 1, reason = left(coalesce(why, ''), 1000), updated_at = statement_timestamp(),
        state = CASE WHEN ended THEN 'failed' ELSE i.state END,
        lease_owner = CASE WHEN ended THEN NULL ELSE i.lease_owner END,
        lease_until = CASE WHEN ended THEN NULL ELSE i.lease_until END
    WHERE i.namespace = ns AND i.id = job
    RETURNING i.*;
END $$;
REVOKE ALL ON FUNCTION tokensvc.ingestion_failed(text,uuid,text,text,integer) FROM PUBLIC, {app_role};
GRANT EXECUTE ON FUNCTION tokensvc.ingestion_failed(text,uuid,text,text,integer) TO {runner_role};

-- Ends the ingestion FAILED with `reason` now (its content is refused), its lease released and
-- its staged chunks gone. Nothing when the lease is not held.
CREATE OR REPLACE FUNCTION tokensvc.fail_ingestion(ns text, job uuid, runner text, why text)
RETURNS SETOF tokensvc.ingestions LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
BEGIN
    BEGIN
        PERFORM tokensvc.held_ingestion(ns, job, runner);
    EXCEPTION WHEN SQLSTATE 'TI001' THEN
        RETURN;
    END;
    DELETE FROM tokensvc.ingestion_chunks c WHERE c.namespace = ns AND c.ingestion = job;
    RETURN QUERY
    UPDATE tokensvc.ingestions i
    SET state = 'failed', reason = left(coalesce(why, ''), 1000), lease_owner = NULL, lease_until = NULL,
        updated_at = statement_timestamp()
    WHERE i.namespace = ns AND i.id = job
    RETURNING i.*;
END $$;
REVOKE ALL ON FUNCTION tokensvc.fail_ingestion(text,uuid,text,text) FROM PUBLIC, {app_role};
GRANT EXECUTE ON FUNCTION tokensvc.fail_ingestion(text,uuid,text,text) TO {runner_role};

-- Removes the ingestion and all it stored (its bytes and staged chunks cascade) when `runner`
-- holds its unexpired lease, or it FAILED (an upload that waited for it and was told why keeps
-- nothing).
CREATE OR REPLACE FUNCTION tokensvc.discard_ingestion(ns text, job uuid, runner text)
RETURNS boolean LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
BEGIN
    DELETE FROM tokensvc.ingestions i
    WHERE i.namespace = ns AND i.id = job
      AND (i.state = 'failed' OR (i.lease_owner = runner AND i.lease_until >= statement_timestamp()));
    RETURN FOUND;
END $$;
REVOKE ALL ON FUNCTION tokensvc.discard_ingestion(text,uuid,text) FROM PUBLIC, {app_role};
GRANT EXECUTE ON FUNCTION tokensvc.discard_ingestion(text,uuid,text) TO {runner_role};

-- The uploaded bytes (TI001 when the lease is not held).
CREATE OR REPLACE FUNCTION tokensvc.ingestion_bytes(ns text, job uuid, runner text)
RETURNS bytea LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    held tokensvc.ingestions := tokensvc.held_ingestion(ns, job, runner);
    bytes bytea;
BEGIN
    SELECT c.content INTO bytes FROM tokensvc.ingestion_content c WHERE c.namespace = ns AND c.ingestion = held.id;
    RETURN bytes;
END $$;
REVOKE ALL ON FUNCTION tokensvc.ingestion_bytes(text,uuid,text) FROM PUBLIC, {app_role};
GRANT EXECUTE ON FUNCTION tokensvc.ingestion_bytes(text,uuid,text) TO {runner_role};

-- The ingestion's knowledge base as pinned now (nothing: deleted), with its generation and its
-- backfilling re-embedding migration, if any: its id, target embedder and chunking (TI001 when the
-- lease is not held).
CREATE OR REPLACE FUNCTION tokensvc.ingestion_base(ns text, job uuid, runner text)
RETURNS TABLE (namespace text, ref text, display_name text, embedder text, model text, dimension integer,
               normalized boolean, chunking text, chunk_size integer, chunk_overlap integer, text_config text,
               created_at timestamptz, generation integer, m_id uuid, m_to_embedder text, m_to_model text,
               m_to_dimension integer, m_to_normalized boolean, m_to_chunking text, m_to_chunk_size integer,
               m_to_chunk_overlap integer)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
#variable_conflict use_column
DECLARE
    held tokensvc.ingestions := tokensvc.held_ingestion(ns, job, runner);
BEGIN
    RETURN QUERY
    SELECT b.namespace, b.ref, b.display_name, b.embedder, b.model, b.dimension, b.normalized, b.chunking,
           b.chunk_size, b.chunk_overlap, b.text_config::text, b.created_at, b.generation, m.id, m.to_embedder,
           m.to_model, m.to_dimension, m.to_normalized, m.to_chunking, m.to_chunk_size, m.to_chunk_overlap
    FROM tokensvc.knowledge_bases b
    LEFT JOIN tokensvc.embedding_migrations m
      ON m.namespace = b.namespace AND m.kb_ref = b.ref AND m.state = 'backfilling'
    WHERE b.namespace = held.namespace AND b.ref = held.kb_ref;
END $$;
REVOKE ALL ON FUNCTION tokensvc.ingestion_base(text,uuid,text) FROM PUBLIC, {app_role};
GRANT EXECUTE ON FUNCTION tokensvc.ingestion_base(text,uuid,text) TO {runner_role};

-- The extraction's result replaces whatever was staged: its text, source spans and recognised
-- type, and its chunks without vectors, cut for the base's `generation` and, where `targets` says
-- so, for the target of the backfilling migration `for_migration`; the ingestion is PROCESSING
-- with `chunks_total` set (both kinds), nothing done, its failures reset. Nothing when the lease
-- is not held.
CREATE OR REPLACE FUNCTION tokensvc.stage_ingestion(
    ns text, job uuid, runner text, for_generation integer, for_migration uuid, extracted text, spans jsonb,
    media_type text, targets boolean[], indexes integer[], texts text[], starts integer[], ends integer[],
    headings text[], locations text[])
RETURNS SETOF tokensvc.ingestions LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    held tokensvc.ingestions;
    staged bigint;
BEGIN
    BEGIN
        held := tokensvc.held_ingestion(ns, job, runner);
    EXCEPTION WHEN SQLSTATE 'TI001' THEN
        RETURN;
    END;
    DELETE FROM tokensvc.ingestion_chunks c WHERE c.namespace = ns AND c.ingestion = job;
    -- RETURNING: on Citus a shard's INSERT ... SELECT (a COPY otherwise, which row-level security
    -- refuses).
    WITH added AS (
        INSERT INTO tokensvc.ingestion_chunks (namespace, ingestion, kb_ref, target, chunk_index, text, start_offset,
                                               end_offset, heading_path, location)
        SELECT ns, job, held.kb_ref, u.target, u.idx, u.text, u.s, u.e,
               ARRAY(SELECT jsonb_array_elements_text(u.heading::jsonb)), u.location::jsonb
        FROM unnest(targets, indexes, texts, starts, ends, headings, locations)
             AS u(target, idx, text, s, e, heading, location)
        RETURNING 1)
    SELECT count(*) INTO staged FROM added;
    UPDATE tokensvc.ingestion_content c SET text = extracted, source_spans = spans, media_type = stage_ingestion.media_type
    WHERE c.namespace = ns AND c.ingestion = job;
    RETURN QUERY
    UPDATE tokensvc.ingestions i
    SET state = 'processing', chunks_total = staged, chunks_done = 0, generation = for_generation,
        migration = for_migration, failures = 0, reason = '', updated_at = statement_timestamp()
    WHERE i.namespace = ns AND i.id = job
    RETURNING i.*;
END $$;
REVOKE ALL ON FUNCTION tokensvc.stage_ingestion(text,uuid,text,integer,uuid,text,jsonb,text,boolean[],integer[],text[],integer[],integer[],text[],text[]) FROM PUBLIC, {app_role};
GRANT EXECUTE ON FUNCTION tokensvc.stage_ingestion(text,uuid,text,integer,uuid,text,jsonb,text,boolean[],integer[],text[],integer[],integer[],text[],text[]) TO {runner_role};

-- Up to `lim` (1..4096) staged chunks without a vector, the base's first, each in chunk order
-- (TI001 when the lease is not held).
CREATE OR REPLACE FUNCTION tokensvc.ingestion_unembedded(ns text, job uuid, runner text, lim integer)
RETURNS TABLE (target boolean, chunk_index integer, text text, start_offset integer, end_offset integer,
               heading_path text[], location jsonb)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
#variable_conflict use_column
DECLARE
    held tokensvc.ingestions := tokensvc.held_ingestion(ns, job, runner);
BEGIN
    IF lim IS NULL OR lim NOT BETWEEN 1 AND 4096 THEN
        RAISE EXCEPTION 'a batch of 1 to 4096 chunks' USING ERRCODE = '22023';
    END IF;
    RETURN QUERY
    SELECT c.target, c.chunk_index, c.text, c.start_offset, c.end_offset, c.heading_path, c.location
    FROM tokensvc.ingestion_chunks c
    WHERE c.namespace = ns AND c.ingestion = held.id AND c.embedding IS NULL
    ORDER BY c.target, c.chunk_index LIMIT lim;
END $$;
REVOKE ALL ON FUNCTION tokensvc.ingestion_unembedded(text,uuid,text,integer) FROM PUBLIC, {app_role};
GRANT EXECUTE ON FUNCTION tokensvc.ingestion_unembedded(text,uuid,text,integer) TO {runner_role};

-- Vectors for staged chunks (by kind and index) and the progress in one commit; a chunk that has
-- one already keeps it (a batch written twice counts once); the failures reset. Nothing when the
-- lease is not held.
CREATE OR REPLACE FUNCTION tokensvc.store_ingestion_vectors(ns text, job uuid, runner text, targets boolean[],
                                                            indexes integer[], vectors vector[])
RETURNS SETOF tokensvc.ingestions LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    written integer := 0;
    one integer;
BEGIN
    BEGIN
        PERFORM tokensvc.held_ingestion(ns, job, runner);
    EXCEPTION WHEN SQLSTATE 'TI001' THEN
        RETURN;
    END;
    IF cardinality(indexes) IS DISTINCT FROM cardinality(vectors)
       OR cardinality(indexes) IS DISTINCT FROM cardinality(targets) THEN
        RAISE EXCEPTION 'one kind and one vector per chunk' USING ERRCODE = '22023';
    END IF;
    -- A row at a time, each a statement of its own: one UPDATE of the whole batch (its vectors
    -- picked from the array) crashed a Citus coordinator (Citus 15.0devel), as the memories'
    -- migration_store found.
    FOR k IN 1 .. coalesce(cardinality(indexes), 0) LOOP
        EXECUTE 'UPDATE tokensvc.ingestion_chunks c SET embedding = $1, dimension = $2 '
                'WHERE c.namespace = $3 AND c.ingestion = $4 AND c.target = $5 AND c.chunk_index = $6 '
                'AND c.embedding IS NULL'
        USING vectors[k], vector_dims(vectors[k]), ns, job, targets[k], indexes[k];
        GET DIAGNOSTICS one = ROW_COUNT;
        written := written + one;
    END LOOP;
    RETURN QUERY
    UPDATE tokensvc.ingestions i
    SET chunks_done = i.chunks_done + written, failures = 0, reason = '', updated_at = statement_timestamp()
    WHERE i.namespace = ns AND i.id = job
    RETURNING i.*;
END $$;
REVOKE ALL ON FUNCTION tokensvc.store_ingestion_vectors(text,uuid,text,boolean[],integer[],vector[]) FROM PUBLIC, {app_role};
GRANT EXECUTE ON FUNCTION tokensvc.store_ingestion_vectors(text,uuid,text,boolean[],integer[],vector[]) TO {runner_role};

-- Makes the version searchable, in a transaction that holds the document's advisory lock (the one
-- uploads take): the base FOR SHARE and the document row FOR UPDATE (document_write_state, which
-- also says whether the ingestion's migration still backfills), then the document row written
-- from the ingestion and its extraction (a new row, or the next version of the existing one,
-- whose chunks of every generation go), its staged chunks copied into `chunks` for the base's
-- generation and, while its migration backfills, its target chunks for the next generation (the
-- version is then migrated already: a migration cuts over while uploads go on), the ingestion
-- gone (its bytes and staged chunks cascade). Without target chunks the version is marked not
-- migrated, and a running migration embeds it in its next pass. The outcome:
--   'ready'      the version is the document's (the document's row follows);
--   'lost'       the lease is not held;
--   'unfinished' not extracted yet, or a chunk without a vector;
--   'stale'      the base cut over since the chunks were staged, or a staged vector is not of its
--                generation's dimension (a vector embedded for other pins): the chunks are dropped
--                and the ingestion is PENDING again, for the pins of now;
--   'superseded' the document already has this version or a newer one (a synchronous write):
--                the ingestion ends.
CREATE OR REPLACE FUNCTION tokensvc.finish_ingestion(ns text, job uuid, runner text)
RETURNS TABLE (outcome text, namespace text, kb_ref text, ref text, version bigint, content_type text,
               content_sha256 bytea, size_bytes bigint, chunk_count integer, metadata jsonb,
               created_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
#variable_conflict use_column
DECLARE
    held tokensvc.ingestions;
    doc_state record;
    content record;
    config regconfig;
    own_chunks bigint;
    target_chunks bigint;
    copied bigint;
    result text;
BEGIN
    BEGIN
        held := tokensvc.held_ingestion(ns, job, runner);
    EXCEPTION WHEN SQLSTATE 'TI001' THEN
        result := 'lost';
    END;
    IF result IS NULL THEN
        SELECT * INTO doc_state FROM tokensvc.document_write_state(held.namespace, held.kb_ref, held.doc_ref,
                                                                    held.migration);
        IF held.chunks_total IS NULL OR held.generation IS NULL OR held.chunks_done < held.chunks_total THEN
            result := 'unfinished';
        ELSIF held.generation IS DISTINCT FROM doc_state.generation OR EXISTS (
            SELECT FROM tokensvc.ingestion_chunks c
            WHERE c.namespace = ns AND c.ingestion = job AND (NOT c.target OR doc_state.dual_write)
              AND c.dimension IS DISTINCT FROM CASE WHEN c.target THEN
                  (SELECT m.to_dimension FROM tokensvc.embedding_migrations m
                   WHERE m.namespace = ns AND m.id = held.migration)
                  ELSE (SELECT b.dimension FROM tokensvc.knowledge_bases b
                        WHERE b.namespace = ns AND b.ref = held.kb_ref) END) THEN
            DELETE FROM tokensvc.ingestion_chunks c WHERE c.namespace = ns AND c.ingestion = job;
            UPDATE tokensvc.ingestions i
            SET state = 'pending', generation = NULL, migration = NULL, chunks_total = NULL, chunks_done = 0,
                updated_at = statement_timestamp()
            WHERE i.namespace = ns AND i.id = job;
            result := 'stale';
        ELSIF doc_state.version IS NOT NULL AND doc_state.version >= held.version THEN
            DELETE FROM tokensvc.ingestions i WHERE i.namespace = ns AND i.id = job;
            result := 'superseded';
        END IF;
    END IF;
    IF result IS NOT NULL THEN
        RETURN QUERY SELECT result, NULL::text, NULL::text, NULL::text, NULL::bigint, NULL::text, NULL::bytea,
                            NULL::bigint, NULL::integer, NULL::jsonb, NULL::timestamptz;
        RETURN;
    END IF;
    SELECT count(*) FILTER (WHERE NOT c.target), count(*) FILTER (WHERE c.target)
      INTO own_chunks, target_chunks
      FROM tokensvc.ingestion_chunks c WHERE c.namespace = ns AND c.ingestion = job;
    IF NOT doc_state.dual_write THEN
        target_chunks := NULL;  -- its migration ended or paused: the target chunks are dropped
    END IF;
    SELECT c.text, c.source_spans, coalesce(c.media_type, held.content_type) AS media_type INTO content
    FROM tokensvc.ingestion_content c WHERE c.namespace = ns AND c.ingestion = job;
    IF doc_state.version IS NULL THEN
        INSERT INTO tokensvc.documents (namespace, kb_ref, ref, version, content_type, content_sha256, size_bytes,
                                        chunk_count, metadata, created_at, text, source_spans, migrated_version,
                                        migrated_chunk_count)
        VALUES (held.namespace, held.kb_ref, held.doc_ref, held.version, content.media_type, held.content_sha256,
                held.size_bytes, own_chunks, held.metadata, clock_timestamp(), content.text, content.source_spans,
                CASE WHEN target_chunks IS NOT NULL THEN held.version END, target_chunks);
    ELSE
        UPDATE tokensvc.documents d
        SET version = held.version, content_type = content.media_type, content_sha256 = held.content_sha256,
            size_bytes = held.size_bytes, chunk_count = own_chunks, metadata = held.metadata,
            text = content.text, source_spans = content.source_spans,
            migrated_version = CASE WHEN target_chunks IS NOT NULL THEN held.version END,
            migrated_chunk_count = target_chunks, updated_at = statement_timestamp()
        WHERE d.namespace = held.namespace AND d.kb_ref = held.kb_ref AND d.ref = held.doc_ref;
        DELETE FROM tokensvc.chunks c
        WHERE c.namespace = held.namespace AND c.kb_ref = held.kb_ref AND c.doc_ref = held.doc_ref
          AND c.version < held.version;
    END IF;
    SELECT b.text_config INTO config FROM tokensvc.knowledge_bases b
    WHERE b.namespace = held.namespace AND b.ref = held.kb_ref;
    WITH added AS (
        INSERT INTO tokensvc.chunks (namespace, kb_ref, doc_ref, generation, version, chunk_index, text,
                                     start_offset, end_offset, heading_path, metadata, dimension, embedding,
                                     text_config, location)
        SELECT s.namespace, held.kb_ref, held.doc_ref, held.generation + s.target::integer, held.version,
               s.chunk_index, s.text, s.start_offset, s.end_offset, s.heading_path, held.metadata, s.dimension,
               s.embedding, config, s.location
        FROM tokensvc.ingestion_chunks s
        WHERE s.namespace = ns AND s.ingestion = job AND (NOT s.target OR target_chunks IS NOT NULL)
        RETURNING 1)
    SELECT count(*) INTO copied FROM added;
    IF copied <> own_chunks + coalesce(target_chunks, 0) THEN
        RAISE EXCEPTION 'ingestion %: % chunks copied, % staged', job, copied, own_chunks + coalesce(target_chunks, 0);
    END IF;
    DELETE FROM tokensvc.ingestions i WHERE i.namespace = ns AND i.id = job;
    RETURN QUERY
    SELECT 'ready'::text, d.namespace, d.kb_ref, d.ref, d.version, d.content_type, d.content_sha256, d.size_bytes,
           d.chunk_count, d.metadata, d.created_at
    FROM tokensvc.documents d
    WHERE d.namespace = held.namespace AND d.kb_ref = held.kb_ref AND d.ref = held.doc_ref;
END $$;
REVOKE ALL ON FUNCTION tokensvc.finish_ingestion(text,uuid,text) FROM PUBLIC, {app_role};
GRANT EXECUTE ON FUNCTION tokensvc.finish_ingestion(text,uuid,text) TO {runner_role};

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
