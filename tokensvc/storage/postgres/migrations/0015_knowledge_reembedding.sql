-- Re-embedding migrations of knowledge bases (issue 16): a knowledge base moves to another
-- embedder, and optionally another chunking strategy, while it serves.
--
-- A knowledge base's chunks carry a generation; the base reads the chunks of its own. A migration
-- writes every current document's chunks of the next generation (re-chunked from the document's
-- stored text when the chunking changes, else the same chunks re-embedded), then cuts over by
-- pinning the target and bumping the base's generation: one row, one atomic switch. Searches
-- filter on (kb_ref, generation) pairs, so no search mixes generations. The old generation's
-- chunks are deleted afterwards.

ALTER TABLE tokensvc.knowledge_bases ADD COLUMN generation integer NOT NULL DEFAULT 0
    CHECK (generation >= 0);

-- `text`: the extracted text the chunks were cut from (NULL for documents uploaded before this
-- migration: they can be re-embedded, not re-chunked). `migrated_version` and
-- `migrated_chunk_count`: the version whose next-generation chunks the running migration has
-- written, and how many (reset when a migration starts).
ALTER TABLE tokensvc.documents
    ADD COLUMN text text,
    ADD COLUMN migrated_version bigint,
    ADD COLUMN migrated_chunk_count integer;

ALTER TABLE tokensvc.chunks ADD COLUMN generation integer NOT NULL DEFAULT 0;
ALTER TABLE tokensvc.chunks
    DROP CONSTRAINT chunks_pkey,
    ADD PRIMARY KEY (namespace, kb_ref, doc_ref, generation, version, chunk_index);
-- A search reads one generation of each base: with the generation in the index, a base's other
-- generation (a migration's, twice the rows for a while) is never read (measured: searches during
-- a migration took 1.9x as long when it was a filter).
CREATE INDEX chunks_kb_generation ON tokensvc.chunks (namespace, kb_ref, generation);
DROP INDEX tokensvc.chunks_kb;

-- A migration moves a memory space (namespace, agent) or a knowledge base (namespace, kb_ref).
ALTER TABLE tokensvc.embedding_migrations
    ALTER COLUMN agent DROP NOT NULL,
    ADD COLUMN kb_ref text,
    ADD COLUMN from_chunking text,
    ADD COLUMN from_chunk_size integer,
    ADD COLUMN from_chunk_overlap integer,
    ADD COLUMN to_chunking text CHECK (to_chunking IN ('fixed', 'recursive', 'markdown')),
    ADD COLUMN to_chunk_size integer,
    ADD COLUMN to_chunk_overlap integer,
    -- The knowledge-base backfill's cursor: documents in ref order.
    ADD COLUMN cursor_document text,
    ADD CONSTRAINT embedding_migrations_subject CHECK ((agent IS NULL) <> (kb_ref IS NULL)),
    ADD CONSTRAINT embedding_migrations_chunking CHECK (
        (kb_ref IS NULL) = (to_chunking IS NULL) AND (to_chunking IS NULL) = (to_chunk_size IS NULL)
        AND (to_chunking IS NULL) = (to_chunk_overlap IS NULL));
CREATE UNIQUE INDEX embedding_migrations_one_per_knowledge_base
    ON tokensvc.embedding_migrations (namespace, kb_ref)
    WHERE kb_ref IS NOT NULL AND state IN ('backfilling', 'paused', 'retiring', 'cancelling');

-- A search that remembered its bases' pins checks them as its transaction starts (0010); the
-- generation is part of a pin now, so a search that embedded its query for the old generation
-- re-reads the pins after a cutover. The three-argument form stays for replicas not yet upgraded.
CREATE FUNCTION tokensvc.expect_knowledge_bases(roster text[], refs text[], created timestamptz[],
                                                generations integer[])
RETURNS void LANGUAGE plpgsql STABLE AS $$
DECLARE
    existing bigint;
    matching bigint;
BEGIN
    SELECT count(*), count(*) FILTER (WHERE (b.ref, b.created_at, b.generation) IN
                                      (SELECT * FROM unnest(refs, created, generations)))
      INTO existing, matching
      FROM tokensvc.knowledge_bases b
     WHERE b.namespace = current_setting('tokensvc.namespace', true) AND b.ref = ANY (roster);
    IF existing <> cardinality(refs) OR matching <> cardinality(refs) THEN
        RAISE EXCEPTION 'the knowledge bases of this search changed' USING ERRCODE = 'TS001';
    END IF;
END $$;
GRANT EXECUTE ON FUNCTION tokensvc.expect_knowledge_bases(text[], text[], timestamptz[], integer[])
    TO {app_role};

-- A base's generation, read FOR SHARE: an upload (and a migration's start) orders itself with a
-- cutover, which locks the row FOR UPDATE. The serving role may not update the table, which FOR
-- SHARE needs; this runs as the owner under the caller's row-level security (its declared tenant).
CREATE FUNCTION tokensvc.knowledge_base_generation(ns text, kb text) RETURNS integer
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
    SELECT generation FROM tokensvc.knowledge_bases WHERE namespace = ns AND ref = kb FOR SHARE
$$;
REVOKE ALL ON FUNCTION tokensvc.knowledge_base_generation(text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION tokensvc.knowledge_base_generation(text, text) TO {app_role};

-- What an upload reads first, in this order: the base's generation (FOR SHARE, as above), the
-- document's current version and hash (FOR UPDATE: the runner's write of the same document waits,
-- or has committed and is visible to the upload's next statement, whose snapshot comes after
-- this lock), and whether `migration` is the base's backfilling migration (a plain read: a
-- cancel takes the base row FOR UPDATE before it changes the migration, so it is ordered by the
-- base row, and no upload waits on a migration row the runner holds).
CREATE FUNCTION tokensvc.document_write_state(ns text, kb text, doc text, migration uuid,
    OUT generation integer, OUT dual_write boolean, OUT version bigint, OUT content_sha256 bytea)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
BEGIN
    SELECT b.generation INTO generation FROM tokensvc.knowledge_bases b
    WHERE b.namespace = ns AND b.ref = kb FOR SHARE;
    SELECT d.version, d.content_sha256 INTO version, content_sha256 FROM tokensvc.documents d
    WHERE d.namespace = ns AND d.kb_ref = kb AND d.ref = doc FOR UPDATE;
    dual_write := migration IS NOT NULL AND EXISTS (
        SELECT 1 FROM tokensvc.embedding_migrations m
        WHERE m.id = migration AND m.namespace = ns AND m.kb_ref = kb AND m.state = 'backfilling');
END $$;
REVOKE ALL ON FUNCTION tokensvc.document_write_state(text, text, text, uuid) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION tokensvc.document_write_state(text, text, text, uuid) TO {app_role};

-- The lock order of everything a migration touches: its subject's row (the memory space or the
-- knowledge base) first, then the migration's row, then the subject's data. Writers take the
-- subject row FOR SHARE and never lock the migration row; a runner's batch takes the subject row
-- FOR SHARE before the migration row (this, with exclusive false); a state change (a cancel) and
-- the cutover take it FOR UPDATE first. So no cycle of waits can form between them.
CREATE FUNCTION tokensvc.lock_migration_subject(migration uuid, exclusive boolean) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    m tokensvc.embedding_migrations;
BEGIN
    SELECT * INTO m FROM tokensvc.embedding_migrations WHERE id = migration;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM set_config('tokensvc.namespace', m.namespace, true);
    IF m.kb_ref IS NOT NULL THEN
        PERFORM set_config('tokensvc.kbs', m.kb_ref, true);
        IF exclusive THEN
            PERFORM 1 FROM tokensvc.knowledge_bases WHERE namespace = m.namespace AND ref = m.kb_ref FOR UPDATE;
        ELSE
            PERFORM 1 FROM tokensvc.knowledge_bases WHERE namespace = m.namespace AND ref = m.kb_ref FOR SHARE;
        END IF;
    ELSE
        PERFORM set_config('tokensvc.agent', m.agent, true);
        IF exclusive THEN
            PERFORM 1 FROM tokensvc.memory_spaces WHERE namespace = m.namespace AND agent = m.agent FOR UPDATE;
        ELSE
            PERFORM 1 FROM tokensvc.memory_spaces WHERE namespace = m.namespace AND agent = m.agent FOR SHARE;
        END IF;
    END IF;
    RETURN true;
END $$;
REVOKE ALL ON FUNCTION tokensvc.lock_migration_subject(uuid, boolean) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION tokensvc.lock_migration_subject(uuid, boolean) TO {app_role};

-- A chunk is written for its base's generation or the next one (a migration's), never an older
-- one: a replica that has not learnt of a cutover (or predates generations, writing the default
-- 0) is refused (SQLSTATE TK003) rather than writing chunks no search reads.
CREATE FUNCTION tokensvc.chunks_generation_guard() RETURNS trigger
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
REVOKE ALL ON FUNCTION tokensvc.chunks_generation_guard() FROM PUBLIC;
CREATE TRIGGER chunks_generation_guard BEFORE INSERT ON tokensvc.chunks
    FOR EACH ROW EXECUTE FUNCTION tokensvc.chunks_generation_guard();

-- 0014's memory-space guard and cutover in the same lock order: the guard reads the migration
-- row without locking it (a cancel is ordered with the write by the space row instead), and the
-- cutover locks the space row before the migration's.
CREATE OR REPLACE FUNCTION tokensvc.memories_generation_guard() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    declared text := current_setting('tokensvc.generation', true);
    dual_write text := current_setting('tokensvc.dual_write', true);
    current_generation integer;
    backfilling uuid;
    other_written boolean;
    other_present boolean;
    keep boolean := false;
BEGIN
    IF declared IS NULL OR declared = '' THEN
        RETURN NEW;  -- not a tenant write: a bucket move, the migration runner, the sweep
    END IF;
    SELECT s.generation INTO current_generation FROM tokensvc.memory_spaces s
    WHERE s.namespace = NEW.namespace AND s.agent = NEW.agent FOR SHARE;
    IF current_generation IS DISTINCT FROM declared::integer THEN
        RAISE EXCEPTION 'memory space %/% is at generation %, not %', NEW.namespace, NEW.agent,
            current_generation, declared USING ERRCODE = 'TK001';
    END IF;
    IF current_generation % 2 = 0 THEN
        other_written := TG_OP = 'INSERT' OR NEW.embedding_b IS DISTINCT FROM OLD.embedding_b;
        other_present := NEW.embedding_b IS NOT NULL;
    ELSE
        other_written := TG_OP = 'INSERT' OR NEW.embedding IS DISTINCT FROM OLD.embedding;
        other_present := NEW.embedding IS NOT NULL;
    END IF;
    IF other_written AND other_present THEN
        -- After the space row's share lock, in a statement of its own (a snapshot taken after
        -- it): a cancel holds the space row FOR UPDATE while it changes the migration, so this
        -- sees a cancel that committed before the lock, and a later cancel waits for this write.
        SELECT m.id INTO backfilling FROM tokensvc.embedding_migrations m
        WHERE m.namespace = NEW.namespace AND m.agent = NEW.agent AND m.state = 'backfilling';
        keep := backfilling IS NOT NULL AND backfilling::text = dual_write;
    END IF;
    IF (other_written AND NOT keep)
       OR (TG_OP = 'UPDATE' AND NEW.content IS DISTINCT FROM OLD.content AND NOT (other_written AND keep)) THEN
        IF current_generation % 2 = 0 THEN
            NEW.embedding_b := NULL;
            NEW.dimension_b := NULL;
        ELSE
            NEW.embedding := NULL;
            NEW.dimension := NULL;
        END IF;
    END IF;
    RETURN NEW;
END $$;

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
    SET state = 'retiring', cut_over_at = clock_timestamp(), updated_at = clock_timestamp(),
        cursor_bucket = NULL, cursor_id = NULL
    WHERE id = migration;
    INSERT INTO tokensvc.audit_events (kind, actor, action, target, outcome, detail)
    VALUES ('embedding_migration', 'system:tokensvc', 'cut over embedding migration',
            format('migration:%s space:%s/%s', m.id, m.namespace, m.agent), 'succeeded',
            format('the space now reads %s (%s)', m.to_embedder, m.to_dimension));
    RETURN true;
END $$;

-- The runner's functions for knowledge bases, as 0014's for memory spaces: each acts for one
-- migration whose lease the caller holds, in the state the work belongs to, and takes the base,
-- the generation and the dimension from the migration's row. They declare that base as the
-- transaction's tenant, so the tables' own row-level security confines them to it.
CREATE FUNCTION tokensvc.leased_knowledge_migration(migration uuid, runner text, wanted text[])
RETURNS tokensvc.embedding_migrations LANGUAGE plpgsql
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    m tokensvc.embedding_migrations := tokensvc.leased_migration(migration, runner, wanted);
BEGIN
    IF m.kb_ref IS NULL THEN
        RAISE EXCEPTION 'migration % is not of a knowledge base', migration USING ERRCODE = 'TK002';
    END IF;
    PERFORM set_config('tokensvc.namespace', m.namespace, true);
    PERFORM set_config('tokensvc.kbs', m.kb_ref, true);
    RETURN m;
END $$;
REVOKE ALL ON FUNCTION tokensvc.leased_knowledge_migration(uuid, text, text[]) FROM PUBLIC;

-- Up to `lim` (1..1000) documents of the base whose current version has no next-generation
-- chunks yet, in ref order after `after_ref` (NULL: the start), with their stored text.
CREATE FUNCTION tokensvc.kb_migration_pending(migration uuid, runner text, after_ref text, lim integer)
RETURNS TABLE (ref text, version bigint, content_sha256 bytea, text text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    m tokensvc.embedding_migrations :=
        tokensvc.leased_knowledge_migration(migration, runner, ARRAY['backfilling']);
BEGIN
    IF lim IS NULL OR lim < 1 OR lim > 1000 THEN
        RAISE EXCEPTION 'a batch of 1 to 1000 documents';
    END IF;
    RETURN QUERY
    SELECT d.ref, d.version, d.content_sha256, d.text FROM tokensvc.documents d
    WHERE d.namespace = m.namespace AND d.kb_ref = m.kb_ref
      AND d.migrated_version IS DISTINCT FROM d.version AND (after_ref IS NULL OR d.ref > after_ref)
    ORDER BY d.ref LIMIT lim;
END $$;

-- The current generation's chunks of these document versions (re-embedded as they are when the
-- migration keeps the chunking), in (document, chunk) order.
CREATE FUNCTION tokensvc.kb_migration_chunks(migration uuid, runner text, refs text[], versions bigint[])
RETURNS TABLE (doc_ref text, chunk_index integer, text text, start_offset integer, end_offset integer,
               heading_path text[])
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    m tokensvc.embedding_migrations :=
        tokensvc.leased_knowledge_migration(migration, runner, ARRAY['backfilling']);
BEGIN
    RETURN QUERY
    SELECT c.doc_ref, c.chunk_index, c.text, c.start_offset, c.end_offset, c.heading_path
    FROM tokensvc.chunks c JOIN unnest(refs, versions) AS u(r, v) ON c.doc_ref = u.r AND c.version = u.v
    WHERE c.namespace = m.namespace AND c.kb_ref = m.kb_ref AND c.generation = m.from_generation
    ORDER BY c.doc_ref, c.chunk_index;
END $$;

-- The next generation's chunks of these document versions, each document written whole with its
-- marker, unless it changed since it was read (another version, or deleted and uploaded again
-- with other content: its version and hash are compared) or is written already. Its row is
-- locked, so an upload waits, or has already moved it on; an upload locks the row in its first
-- statement, so its later ones see what this wrote. `chunk_docs` gives each chunk's document as
-- a position (1-based) in `refs`. Returns how many documents were written. No chunk of the target
-- generation can exist for a version without its marker: an upload writes both or neither, a new
-- version deletes the old one's chunks, and a cancel deletes the generation. The caller holds the
-- base row FOR SHARE (lock_migration_subject) before this locks the migration row.
CREATE FUNCTION tokensvc.kb_migration_store(
    migration uuid, runner text, refs text[], versions bigint[], hashes bytea[], chunk_docs integer[],
    indexes integer[], texts text[], starts integer[], ends integer[], headings text[], vectors vector[])
RETURNS integer LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
DECLARE
    m tokensvc.embedding_migrations :=
        tokensvc.leased_knowledge_migration(migration, runner, ARRAY['backfilling']);
    written integer;
BEGIN
    IF EXISTS (SELECT 1 FROM unnest(vectors) v WHERE vector_dims(v) <> m.to_dimension) THEN
        RAISE EXCEPTION 'a vector is not of the migration''s dimension %', m.to_dimension;
    END IF;
    WITH batch AS MATERIALIZED (
        SELECT u.p::integer AS position, d.ref, d.version, d.metadata
        FROM unnest(refs, versions, hashes) WITH ORDINALITY AS u(r, v, h, p)
        JOIN tokensvc.documents d ON d.namespace = m.namespace AND d.kb_ref = m.kb_ref AND d.ref = u.r
        WHERE d.version = u.v AND d.content_sha256 = u.h AND d.migrated_version IS DISTINCT FROM d.version
        FOR UPDATE OF d
    ), added AS (
        INSERT INTO tokensvc.chunks (namespace, kb_ref, doc_ref, generation, version, chunk_index, text,
                                     start_offset, end_offset, heading_path, metadata, dimension,
                                     embedding, text_config)
        SELECT m.namespace, m.kb_ref, b.ref, m.from_generation + 1, b.version, u.idx, u.text, u.s, u.e,
               ARRAY(SELECT jsonb_array_elements_text(u.heading::jsonb)), b.metadata, m.to_dimension,
               u.vec, (SELECT k.text_config FROM tokensvc.knowledge_bases k
                       WHERE k.namespace = m.namespace AND k.ref = m.kb_ref)
        FROM unnest(chunk_docs, indexes, texts, starts, ends, headings, vectors)
             AS u(doc, idx, text, s, e, heading, vec)
        JOIN batch b ON b.position = u.doc
    ), marked AS (
        UPDATE tokensvc.documents d SET migrated_version = b.version,
            migrated_chunk_count = (SELECT count(*) FROM unnest(chunk_docs) AS c(doc) WHERE c.doc = b.position)
        FROM batch b WHERE d.namespace = m.namespace AND d.kb_ref = m.kb_ref AND d.ref = b.ref
        RETURNING 1
    )
    SELECT count(*) INTO written FROM marked;
    RETURN written;
END $$;

-- Deletes the chunks of the generation the migration leaves behind (RETIRING: the old one;
-- CANCELLING: its target) of up to `lim` documents, each document's row locked first (ref order),
-- as an upload locks it before it deletes or updates its chunks, so the two never deadlock over
-- chunk rows; renews the lease; returns how many chunks (0: done).
CREATE FUNCTION tokensvc.kb_migration_clear(migration uuid, runner text, lim integer, lease_seconds float8)
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
    SET lease_until = clock_timestamp() + make_interval(secs => lease_seconds), updated_at = clock_timestamp()
    WHERE id = migration;
    RETURN deleted;
END $$;

-- The cutover, as the owner (the serving role cannot change a pin): with the base row locked
-- (before the migration's: the lock order above), so no upload is in flight (an upload reads it
-- FOR SHARE), it checks that every document's current
-- version has its next-generation chunks, then pins the target and bumps the generation. Returns
-- false (and changes nothing) when a document lacks them, or the caller no longer holds the
-- lease. A base deleted meanwhile cancels its migration (nothing is left to clean).
CREATE FUNCTION tokensvc.cut_over_knowledge_base(migration uuid, runner text) RETURNS boolean
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
            lease_until = NULL, updated_at = clock_timestamp(), finished_at = clock_timestamp()
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
    SET state = 'retiring', cut_over_at = clock_timestamp(), updated_at = clock_timestamp(),
        cursor_document = NULL
    WHERE id = migration;
    INSERT INTO tokensvc.audit_events (kind, actor, action, target, outcome, detail)
    VALUES ('embedding_migration', 'system:tokensvc', 'cut over embedding migration',
            format('migration:%s knowledge_base:%s/%s', m.id, m.namespace, m.kb_ref), 'succeeded',
            format('the knowledge base now reads %s (%s), %s chunking (%s/%s)', m.to_embedder,
                   m.to_dimension, m.to_chunking, m.to_chunk_size, m.to_chunk_overlap));
    RETURN true;
END $$;

DO $$
DECLARE
    f text;
BEGIN
    FOREACH f IN ARRAY ARRAY[
        'kb_migration_pending(uuid, text, text, integer)',
        'kb_migration_chunks(uuid, text, text[], bigint[])',
        'kb_migration_store(uuid, text, text[], bigint[], bytea[], integer[], integer[], text[], '
            'integer[], integer[], text[], vector[])',
        'kb_migration_clear(uuid, text, integer, float8)',
        'cut_over_knowledge_base(uuid, text)']
    LOOP
        EXECUTE format('REVOKE ALL ON FUNCTION tokensvc.%s FROM PUBLIC', f);
        EXECUTE format('GRANT EXECUTE ON FUNCTION tokensvc.%s TO {app_role}', f);
    END LOOP;
END $$;
