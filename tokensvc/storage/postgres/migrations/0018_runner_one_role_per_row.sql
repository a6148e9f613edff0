-- The re-embedding runner on Citus (issue 19): in each of its transactions a row is locked and
-- written by one role only, and no UPDATE of a distributed or reference table calls a volatile
-- function.
--
-- Citus opens its worker connections per role. A batch's transaction used to lock the migration
-- row FOR UPDATE as the serving role, then call an owner function that locked the same row again
-- (leased_migration), then update it as the serving role: on one node that is one backend, on
-- Citus the owner's worker connection waited on the serving role's, a deadlock Citus cancels.
-- A batch now takes its locks and records its progress through owner functions only
-- (hold_migration, migration_progress), in 0015's lock order: the subject row FOR SHARE, then the
-- migration row FOR UPDATE, then the subject's data.
--
-- The runner's transactions declare the subject's tenant themselves (the service's `declare`,
-- which reaches the workers); the set_config calls of 0014 and 0015 set the same values on the
-- coordinator and stay, so replicas of the previous release keep working on one node.
--
-- Replaced in place, with the same signatures (grants are kept, older replicas unaffected): the
-- clean-ups and cutovers, whose UPDATEs wrote clock_timestamp(), which Citus refuses there. They
-- write statement_timestamp() now, as the service's own UPDATEs do.

-- In a batch's transaction: the subject row FOR SHARE (lock_migration_subject), then the migration
-- row FOR UPDATE when `runner` holds the BACKFILLING migration's lease. Returns whether it does.
CREATE FUNCTION tokensvc.hold_migration(migration uuid, runner text) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
BEGIN
    IF runner IS NULL OR NOT tokensvc.lock_migration_subject(migration, false) THEN
        RETURN false;
    END IF;
    PERFORM 1 FROM tokensvc.embedding_migrations
    WHERE id = migration AND state = 'backfilling' AND lease_owner = runner
      AND lease_until >= statement_timestamp()
    FOR UPDATE;
    RETURN FOUND;
END $$;

-- A batch's progress, in the transaction that held the migration (hold_migration): `written`
-- more rows done, the cursor moved to the batch's last memory or document (NULL: unchanged), the
-- lease renewed. Returns the migration's row, none when `runner` no longer holds it.
CREATE FUNCTION tokensvc.migration_progress(migration uuid, runner text, written integer,
                                            after_bucket text, after_id uuid, after_document text,
                                            lease_seconds float8)
RETURNS SETOF tokensvc.embedding_migrations LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
BEGIN
    IF written IS NULL OR written < 0 OR lease_seconds IS NULL OR lease_seconds <= 0
       OR (after_bucket IS NULL) <> (after_id IS NULL) THEN
        RAISE EXCEPTION 'a batch''s progress: rows written, a whole cursor and a lease';
    END IF;
    RETURN QUERY
    UPDATE tokensvc.embedding_migrations
    SET rows_done = rows_done + written, rows_total = greatest(rows_total, rows_done + written),
        failures = 0, reason = '', cursor_bucket = coalesce(after_bucket, cursor_bucket),
        cursor_id = coalesce(after_id, cursor_id), cursor_document = coalesce(after_document, cursor_document),
        lease_until = statement_timestamp() + make_interval(secs => lease_seconds),
        updated_at = statement_timestamp()
    WHERE id = migration AND state = 'backfilling' AND lease_owner = runner
    RETURNING *;
END $$;

DO $$
DECLARE
    f text;
BEGIN
    FOREACH f IN ARRAY ARRAY[
        'hold_migration(uuid, text)',
        'migration_progress(uuid, text, integer, text, uuid, text, float8)']
    LOOP
        EXECUTE format('REVOKE ALL ON FUNCTION tokensvc.%s FROM PUBLIC', f);
        EXECUTE format('GRANT EXECUTE ON FUNCTION tokensvc.%s TO {app_role}', f);
    END LOOP;
END $$;

-- 0015's write of a batch of documents' next-generation chunks, as three statements that each
-- read or write one table: Citus cannot plan 0015's single statement (an INSERT of chunks joined
-- with a locking CTE over documents and a subquery of knowledge_bases) on the shards. Same
-- contract: the documents unchanged since they were read are locked (in ref order), their chunks
-- written and their markers set; returns how many documents were written.
CREATE OR REPLACE FUNCTION tokensvc.kb_migration_store(
    migration uuid, runner text, refs text[], versions bigint[], hashes bytea[], chunk_docs integer[],
    indexes integer[], texts text[], starts integer[], ends integer[], headings text[], vectors vector[])
RETURNS integer LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    m tokensvc.embedding_migrations :=
        tokensvc.leased_knowledge_migration(migration, runner, ARRAY['backfilling']);
    config regconfig;
    doc record;
    positions integer[] := '{}';
    locked_refs text[] := '{}';
    locked_versions bigint[] := '{}';
    locked_metadata jsonb[] := '{}';
    chunks_written bigint;
    written integer;
BEGIN
    IF EXISTS (SELECT 1 FROM unnest(vectors) v WHERE vector_dims(v) <> m.to_dimension) THEN
        RAISE EXCEPTION 'a vector is not of the migration''s dimension %', m.to_dimension;
    END IF;
    SELECT k.text_config INTO config FROM tokensvc.knowledge_bases k
    WHERE k.namespace = m.namespace AND k.ref = m.kb_ref;
    FOR doc IN
        SELECT u.p::integer AS position, d.ref, d.version, d.metadata
        FROM unnest(refs, versions, hashes) WITH ORDINALITY AS u(r, v, h, p)
        JOIN tokensvc.documents d ON d.namespace = m.namespace AND d.kb_ref = m.kb_ref AND d.ref = u.r
        WHERE d.version = u.v AND d.content_sha256 = u.h AND d.migrated_version IS DISTINCT FROM d.version
        ORDER BY d.ref
        FOR UPDATE OF d
    LOOP
        positions := positions || doc.position;
        locked_refs := locked_refs || doc.ref;
        locked_versions := locked_versions || doc.version;
        locked_metadata := locked_metadata || doc.metadata;
    END LOOP;
    WITH added AS (
    INSERT INTO tokensvc.chunks (namespace, kb_ref, doc_ref, generation, version, chunk_index, text,
                                 start_offset, end_offset, heading_path, metadata, dimension,
                                 embedding, text_config)
    SELECT m.namespace, m.kb_ref, b.ref, m.from_generation + 1, b.version, u.idx, u.text, u.s, u.e,
           ARRAY(SELECT jsonb_array_elements_text(u.heading::jsonb)), b.metadata, m.to_dimension,
           u.vec, config
    FROM unnest(chunk_docs, indexes, texts, starts, ends, headings, vectors)
         AS u(doc, idx, text, s, e, heading, vec)
    JOIN unnest(positions, locked_refs, locked_versions, locked_metadata) AS b(position, ref, version, metadata)
      ON b.position = u.doc
    RETURNING 1)
    SELECT count(*) INTO chunks_written FROM added;
    UPDATE tokensvc.documents d SET migrated_version = b.version,
        migrated_chunk_count = (SELECT count(*) FROM unnest(chunk_docs) AS c(doc) WHERE c.doc = b.position)
    FROM unnest(positions, locked_refs, locked_versions) AS b(position, ref, version)
    WHERE d.namespace = m.namespace AND d.kb_ref = m.kb_ref AND d.ref = b.ref;
    GET DIAGNOSTICS written = ROW_COUNT;
    RETURN written;
END $$;

-- 0014's clean-up of a memory space, with statement_timestamp().
CREATE OR REPLACE FUNCTION tokensvc.migration_clear(migration uuid, runner text, lim integer, lease_seconds float8)
RETURNS integer LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    m tokensvc.embedding_migrations :=
        tokensvc.leased_migration(migration, runner, ARRAY['retiring', 'cancelling']);
    slot integer := CASE WHEN m.state = 'retiring' THEN m.from_generation % 2
                         ELSE (m.from_generation + 1) % 2 END;
    held integer;
    last_bucket text;
    last_id uuid;
BEGIN
    IF lim IS NULL OR lim < 1 OR lim > 10000 THEN
        RAISE EXCEPTION 'a batch of 1 to 10000 memories';
    END IF;
    EXECUTE format(
        'WITH batch AS (SELECT bucket, id FROM tokensvc.memories WHERE namespace = $1 AND agent = $2 '
        '  AND %1$I IS NOT NULL AND ($3::text IS NULL OR (bucket, id) > ($3, $4)) '
        '  ORDER BY bucket, id LIMIT $5), '
        'done AS (UPDATE tokensvc.memories x SET %2$I = NULL, %1$I = NULL FROM batch '
        '  WHERE x.bucket = batch.bucket AND x.id = batch.id) '
        'SELECT (SELECT count(*)::integer FROM batch), b.bucket, b.id FROM (SELECT 1) AS one '
        'LEFT JOIN (SELECT bucket, id FROM batch ORDER BY bucket DESC, id DESC LIMIT 1) AS b ON true',
        CASE WHEN slot = 0 THEN 'dimension' ELSE 'dimension_b' END,
        CASE WHEN slot = 0 THEN 'embedding' ELSE 'embedding_b' END)
    INTO held, last_bucket, last_id
    USING m.namespace, m.agent, m.cursor_bucket, m.cursor_id, lim;
    UPDATE tokensvc.embedding_migrations
    SET cursor_bucket = coalesce(last_bucket, cursor_bucket), cursor_id = coalesce(last_id, cursor_id),
        lease_until = statement_timestamp() + make_interval(secs => lease_seconds),
        updated_at = statement_timestamp()
    WHERE id = migration;
    RETURN held;
END $$;

-- 0015's clean-up of a knowledge base, with statement_timestamp().
CREATE OR REPLACE FUNCTION tokensvc.kb_migration_clear(migration uuid, runner text, lim integer, lease_seconds float8)
RETURNS integer LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    m tokensvc.embedding_migrations :=
        tokensvc.leased_knowledge_migration(migration, runner, ARRAY['retiring', 'cancelling']);
    gone integer := CASE WHEN m.state = 'retiring' THEN m.from_generation ELSE m.from_generation + 1 END;
    deleted integer;
BEGIN
    IF lim IS NULL OR lim < 1 OR lim > 10000 THEN
        RAISE EXCEPTION 'a batch of 1 to 10000 documents';
    END IF;
    WITH batch AS MATERIALIZED (
        SELECT d.ref FROM tokensvc.documents d
        WHERE d.namespace = m.namespace AND d.kb_ref = m.kb_ref AND EXISTS (
            SELECT 1 FROM tokensvc.chunks c WHERE c.namespace = d.namespace AND c.kb_ref = d.kb_ref
              AND c.doc_ref = d.ref AND c.generation = gone)
        ORDER BY d.ref LIMIT lim FOR UPDATE OF d
    )
    DELETE FROM tokensvc.chunks c USING batch b
    WHERE c.namespace = m.namespace AND c.kb_ref = m.kb_ref AND c.doc_ref = b.ref AND c.generation = gone;
    GET DIAGNOSTICS deleted = ROW_COUNT;
    UPDATE tokensvc.embedding_migrations
    SET lease_until = statement_timestamp() + make_interval(secs => lease_seconds),
        updated_at = statement_timestamp()
    WHERE id = migration;
    RETURN deleted;
END $$;

-- 0015's cutover of a memory space, with statement_timestamp().
CREATE OR REPLACE FUNCTION tokensvc.cut_over_memory_space(migration uuid, runner text) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    m tokensvc.embedding_migrations;
    current_generation integer;
BEGIN
    IF NOT tokensvc.lock_migration_subject(migration, true) THEN
        RETURN false;
    END IF;
    SELECT * INTO m FROM tokensvc.embedding_migrations WHERE id = migration FOR UPDATE;
    IF m.agent IS NULL OR m.state <> 'backfilling' OR runner IS NULL OR m.lease_owner IS DISTINCT FROM runner
       OR m.lease_until IS NULL OR m.lease_until < clock_timestamp() THEN
        RETURN false;
    END IF;
    SELECT generation INTO current_generation FROM tokensvc.memory_spaces
    WHERE namespace = m.namespace AND agent = m.agent;
    IF current_generation IS DISTINCT FROM m.from_generation THEN
        RAISE EXCEPTION 'memory space %/% is at generation %, the migration started from %',
            m.namespace, m.agent, current_generation, m.from_generation;
    END IF;
    IF EXISTS (
        SELECT 1 FROM tokensvc.memories
        WHERE namespace = m.namespace AND agent = m.agent AND (expires_at IS NULL OR expires_at > now())
          AND CASE WHEN m.from_generation % 2 = 0 THEN dimension_b IS DISTINCT FROM m.to_dimension
                   ELSE dimension IS DISTINCT FROM m.to_dimension END
    ) THEN
        RETURN false;
    END IF;
    UPDATE tokensvc.memory_spaces
    SET embedder = m.to_embedder, model = m.to_model, dimension = m.to_dimension,
        normalized = m.to_normalized, generation = m.from_generation + 1
    WHERE namespace = m.namespace AND agent = m.agent;
    UPDATE tokensvc.embedding_migrations
    SET state = 'retiring', cut_over_at = statement_timestamp(), updated_at = statement_timestamp(),
        cursor_bucket = NULL, cursor_id = NULL
    WHERE id = migration;
    INSERT INTO tokensvc.audit_events (kind, actor, action, target, outcome, detail)
    VALUES ('embedding_migration', 'system:tokensvc', 'cut over embedding migration',
            format('migration:%s space:%s/%s', m.id, m.namespace, m.agent), 'succeeded',
            format('the space now reads %s (%s)', m.to_embedder, m.to_dimension));
    RETURN true;
END $$;

-- 0015's cutover of a knowledge base, with statement_timestamp().
CREATE OR REPLACE FUNCTION tokensvc.cut_over_knowledge_base(migration uuid, runner text) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    m tokensvc.embedding_migrations;
    current_generation integer;
BEGIN
    IF NOT tokensvc.lock_migration_subject(migration, true) THEN
        RETURN false;
    END IF;
    SELECT * INTO m FROM tokensvc.embedding_migrations WHERE id = migration FOR UPDATE;
    IF m.kb_ref IS NULL OR m.state <> 'backfilling' OR runner IS NULL
       OR m.lease_owner IS DISTINCT FROM runner OR m.lease_until IS NULL OR m.lease_until < clock_timestamp() THEN
        RETURN false;
    END IF;
    SELECT generation INTO current_generation FROM tokensvc.knowledge_bases
    WHERE namespace = m.namespace AND ref = m.kb_ref;
    IF NOT FOUND THEN
        UPDATE tokensvc.embedding_migrations
        SET state = 'cancelled', reason = 'the knowledge base was deleted', lease_owner = NULL,
            lease_until = NULL, updated_at = statement_timestamp(), finished_at = statement_timestamp()
        WHERE id = migration;
        RETURN false;
    END IF;
    IF current_generation IS DISTINCT FROM m.from_generation THEN
        RAISE EXCEPTION 'knowledge base %/% is at generation %, the migration started from %',
            m.namespace, m.kb_ref, current_generation, m.from_generation;
    END IF;
    IF EXISTS (SELECT 1 FROM tokensvc.documents WHERE namespace = m.namespace AND kb_ref = m.kb_ref
               AND migrated_version IS DISTINCT FROM version) THEN
        RETURN false;
    END IF;
    UPDATE tokensvc.knowledge_bases
    SET embedder = m.to_embedder, model = m.to_model, dimension = m.to_dimension,
        normalized = m.to_normalized, chunking = m.to_chunking, chunk_size = m.to_chunk_size,
        chunk_overlap = m.to_chunk_overlap, generation = m.from_generation + 1
    WHERE namespace = m.namespace AND ref = m.kb_ref;
    UPDATE tokensvc.documents SET chunk_count = migrated_chunk_count
    WHERE namespace = m.namespace AND kb_ref = m.kb_ref;
    UPDATE tokensvc.embedding_migrations
    SET state = 'retiring', cut_over_at = statement_timestamp(), updated_at = statement_timestamp(),
        cursor_document = NULL
    WHERE id = migration;
    INSERT INTO tokensvc.audit_events (kind, actor, action, target, outcome, detail)
    VALUES ('embedding_migration', 'system:tokensvc', 'cut over embedding migration',
            format('migration:%s knowledge_base:%s/%s', m.id, m.namespace, m.kb_ref), 'succeeded',
            format('the knowledge base now reads %s (%s), %s chunking (%s/%s)', m.to_embedder,
                   m.to_dimension, m.to_chunking, m.to_chunk_size, m.to_chunk_overlap));
    RETURN true;
END $$;
