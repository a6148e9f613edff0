-- Re-embedding a knowledge base: the guard that keeps chunks on the base's current generation,
-- the backfill's batches, the clean-up of the old chunks and the cutover.
--
-- Applied after the numbered migrations whenever this file changes (docs/development.md,
-- "Changing a SQL function"): each definition is the current one, in place.


-- A chunk is written for its base's generation or the next one (a migration's), never an older
-- one: a replica that has not learnt of a cutover (or predates generations, writing the default
-- 0) is refused (SQLSTATE TK003) rather than writing chunks no search reads.
CREATE OR REPLACE FUNCTION tokensvc.chunks_generation_guard() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    current_generation integer;
BEGIN
    SELECT b.generation INTO current_generation FROM tokensvc.knowledge_bases b
    WHERE b.namespace = NEW.namespace AND b.ref = NEW.kb_ref;
    IF current_generation IS NOT NULL AND NEW.generation NOT IN (current_generation, current_generation + 1) THEN
        RAISE EXCEPTION 'knowledge base %/% is at generation %, not %', NEW.namespace, NEW.kb_ref,
            current_generation, NEW.generation USING ERRCODE = 'TK003';
    END IF;
    RETURN NEW;
END $$;
REVOKE ALL ON FUNCTION tokensvc.chunks_generation_guard() FROM PUBLIC, {app_role}, {runner_role};

-- Created when missing, never replaced: on Citus a trigger's DDL on a placed table goes to the
-- workers only from inside a DO block. To change it, a numbered migration drops it (in a DO block)
-- and this file, applied after, creates it anew (docs/development.md).
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_trigger WHERE tgrelid = 'tokensvc.chunks'::regclass
                   AND tgname = 'chunks_generation_guard') THEN
        CREATE TRIGGER chunks_generation_guard BEFORE INSERT ON tokensvc.chunks
            FOR EACH ROW EXECUTE FUNCTION tokensvc.chunks_generation_guard();
    END IF;
END $$;

-- Up to `lim` (1..1000) documents of the base whose current version has no next-generation
-- chunks yet, in ref order after `after_ref` (NULL: the start), with their stored text and source
-- spans (what a re-chunking cuts and locates its chunks against).
CREATE OR REPLACE FUNCTION tokensvc.kb_migration_pending(migration uuid, runner text, after_ref text, lim integer)
RETURNS TABLE (ref text, version bigint, content_sha256 bytea, text text, source_spans jsonb)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    m tokensvc.embedding_migrations :=
        tokensvc.leased_knowledge_migration(migration, runner, ARRAY['backfilling']);
BEGIN
    IF lim IS NULL OR lim < 1 OR lim > 1000 THEN
        RAISE EXCEPTION 'a batch of 1 to 1000 documents';
    END IF;
    RETURN QUERY
    SELECT d.ref, d.version, d.content_sha256, d.text, d.source_spans FROM tokensvc.documents d
    WHERE d.namespace = m.namespace AND d.kb_ref = m.kb_ref
      AND d.migrated_version IS DISTINCT FROM d.version AND (after_ref IS NULL OR d.ref > after_ref)
    ORDER BY d.ref LIMIT lim;
END $$;
REVOKE ALL ON FUNCTION tokensvc.kb_migration_pending(uuid,text,text,integer) FROM PUBLIC, {app_role};
GRANT EXECUTE ON FUNCTION tokensvc.kb_migration_pending(uuid,text,text,integer) TO {runner_role};

-- The current generation's chunks of these document versions (re-embedded as they are when the
-- migration keeps the chunking), in (document, chunk) order.
CREATE OR REPLACE FUNCTION tokensvc.kb_migration_chunks(migration uuid, runner text, refs text[], versions bigint[])
RETURNS TABLE (doc_ref text, chunk_index integer, text text, start_offset integer, end_offset integer,
               heading_path text[], location jsonb)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    m tokensvc.embedding_migrations :=
        tokensvc.leased_knowledge_migration(migration, runner, ARRAY['backfilling']);
BEGIN
    RETURN QUERY
    SELECT c.doc_ref, c.chunk_index, c.text, c.start_offset, c.end_offset, c.heading_path, c.location
    FROM tokensvc.chunks c JOIN unnest(refs, versions) AS u(r, v) ON c.doc_ref = u.r AND c.version = u.v
    WHERE c.namespace = m.namespace AND c.kb_ref = m.kb_ref AND c.generation = m.from_generation
    ORDER BY c.doc_ref, c.chunk_index;
END $$;
REVOKE ALL ON FUNCTION tokensvc.kb_migration_chunks(uuid,text,text[],bigint[]) FROM PUBLIC, {app_role};
GRANT EXECUTE ON FUNCTION tokensvc.kb_migration_chunks(uuid,text,text[],bigint[]) TO {runner_role};

-- A batch of documents' next-generation chunks: the documents unchanged since they were read are
-- locked (in ref order), their chunks written (with their locations: JSON text or NULL per chunk)
-- and their markers set; returns how many documents were written. Three statements that each read or write one table: Citus cannot plan one INSERT
-- of chunks joined with a locking CTE over documents and a subquery of knowledge_bases.
CREATE OR REPLACE FUNCTION tokensvc.kb_migration_store(
    migration uuid, runner text, refs text[], versions bigint[], hashes bytea[], chunk_docs integer[],
    indexes integer[], texts text[], starts integer[], ends integer[], headings text[], vectors vector[],
    locations text[])
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
                                 embedding, text_config, location)
    SELECT m.namespace, m.kb_ref, b.ref, m.from_generation + 1, b.version, u.idx, u.text, u.s, u.e,
           ARRAY(SELECT jsonb_array_elements_text(u.heading::jsonb)), b.metadata, m.to_dimension,
           u.vec, config, u.location::jsonb
    FROM unnest(chunk_docs, indexes, texts, starts, ends, headings, vectors, locations)
         AS u(doc, idx, text, s, e, heading, vec, location)
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
REVOKE ALL ON FUNCTION tokensvc.kb_migration_store(uuid,text,text[],bigint[],bytea[],integer[],integer[],text[],integer[],integer[],text[],vector[],text[]) FROM PUBLIC, {app_role};
GRANT EXECUTE ON FUNCTION tokensvc.kb_migration_store(uuid,text,text[],bigint[],bytea[],integer[],integer[],text[],integer[],integer[],text[],vector[],text[]) TO {runner_role};

-- The same without locations, as runners of the previous release call it (drop it a release after
-- the one that added locations).
CREATE OR REPLACE FUNCTION tokensvc.kb_migration_store(
    migration uuid, runner text, refs text[], versions bigint[], hashes bytea[], chunk_docs integer[],
    indexes integer[], texts text[], starts integer[], ends integer[], headings text[], vectors vector[])
RETURNS integer LANGUAGE sql SECURITY DEFINER
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
    SELECT tokensvc.kb_migration_store(migration, runner, refs, versions, hashes, chunk_docs, indexes,
                                       texts, starts, ends, headings, vectors, NULL::text[])
$$;
REVOKE ALL ON FUNCTION tokensvc.kb_migration_store(uuid,text,text[],bigint[],bytea[],integer[],integer[],text[],integer[],integer[],text[],vector[]) FROM PUBLIC, {app_role};
GRANT EXECUTE ON FUNCTION tokensvc.kb_migration_store(uuid,text,text[],bigint[],bytea[],integer[],integer[],text[],integer[],integer[],text[],vector[]) TO {runner_role};

-- A knowledge base's clean-up batch (after a cutover or a cancel): up to `lim` documents' chunks
-- of the slot no search reads. Writes statement_timestamp(): Citus refuses clock_timestamp() there.
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
REVOKE ALL ON FUNCTION tokensvc.kb_migration_clear(uuid,text,integer,double precision) FROM PUBLIC, {app_role};
GRANT EXECUTE ON FUNCTION tokensvc.kb_migration_clear(uuid,text,integer,double precision) TO {runner_role};

-- A knowledge base's cutover to the migration's generation, for the runner holding the lease.
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
REVOKE ALL ON FUNCTION tokensvc.cut_over_knowledge_base(uuid,text) FROM PUBLIC, {app_role};
GRANT EXECUTE ON FUNCTION tokensvc.cut_over_knowledge_base(uuid,text) TO {runner_role};
