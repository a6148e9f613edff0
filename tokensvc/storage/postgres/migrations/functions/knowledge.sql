-- Knowledge bases: the pins a search expects, a base's generation, and a document write's
-- state, read under the caller's row-level security.
--
-- Applied after the numbered migrations whenever this file changes (docs/development.md,
-- "Changing a SQL function"): each definition is the current one, in place.


-- A knowledge search that embedded its query with the pins it remembered (which bases of the
-- roster exist, each with its creation time) checks them as its transaction starts, in the same
-- message: it fails with SQLSTATE TS001 when a base was created, deleted or re-created since, and
-- the caller re-reads the pins and searches again. So a search never mixes a stale embedder's
-- query with another corpus's vectors, and costs no extra round trip when the pins hold.
-- SECURITY INVOKER: it sees only what the transaction's declared tenant may see.
CREATE OR REPLACE FUNCTION tokensvc.expect_knowledge_bases(roster text[], refs text[], created timestamptz[])
RETURNS void LANGUAGE plpgsql STABLE AS $$
DECLARE
    existing bigint;
    matching bigint;
BEGIN
    SELECT count(*), count(*) FILTER (WHERE (b.ref, b.created_at) IN (SELECT * FROM unnest(refs, created)))
      INTO existing, matching
      FROM tokensvc.knowledge_bases b
     WHERE b.namespace = current_setting('tokensvc.namespace', true) AND b.ref = ANY (roster);
    IF existing <> cardinality(refs) OR matching <> cardinality(refs) THEN
        RAISE EXCEPTION 'the knowledge bases of this search changed' USING ERRCODE = 'TS001';
    END IF;
END $$;
REVOKE ALL ON FUNCTION tokensvc.expect_knowledge_bases(text[],text[],timestamp with time zone[]) FROM {runner_role};
GRANT EXECUTE ON FUNCTION tokensvc.expect_knowledge_bases(text[],text[],timestamp with time zone[]) TO {app_role};

-- The same check with each base's generation as part of its pin, so a search that embedded its
-- query for the old generation re-reads the pins after a cutover. (The three-argument form above
-- is kept for replicas of earlier releases.)
CREATE OR REPLACE FUNCTION tokensvc.expect_knowledge_bases(roster text[], refs text[], created timestamptz[],
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
REVOKE ALL ON FUNCTION tokensvc.expect_knowledge_bases(text[],text[],timestamp with time zone[],integer[]) FROM {runner_role};
GRANT EXECUTE ON FUNCTION tokensvc.expect_knowledge_bases(text[],text[],timestamp with time zone[],integer[]) TO {app_role};

-- A base's generation, read FOR SHARE: an upload, the finish of an ingested version and a
-- migration's start order themselves with a cutover, which locks the row FOR UPDATE. The serving role may not update the table, which FOR
-- SHARE needs; this runs as the owner under the caller's row-level security (its declared tenant).
CREATE OR REPLACE FUNCTION tokensvc.knowledge_base_generation(ns text, kb text) RETURNS integer
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
    SELECT generation FROM tokensvc.knowledge_bases WHERE namespace = ns AND ref = kb FOR SHARE
$$;
REVOKE ALL ON FUNCTION tokensvc.knowledge_base_generation(text,text) FROM PUBLIC, {runner_role};
GRANT EXECUTE ON FUNCTION tokensvc.knowledge_base_generation(text,text) TO {app_role};

-- A document write's state: its base's generation (read FOR SHARE as the owner, through
-- knowledge_base_generation) and its document row, locked FOR UPDATE by the writer itself (the
-- serving role, or the owner's finish_ingestion).
-- Not as the owner: Citus opens a worker connection per role, so an owner's lock would be held by
-- one worker backend while the serving role's UPDATE (or its chunks' foreign-key check) waited on
-- it from another, inside the same distributed transaction: a deadlock Citus cancels. The serving
-- role may update documents, so it may lock them; row-level security scopes the lock to its
-- declared tenant. The lock order: the base row, then the document row.
CREATE OR REPLACE FUNCTION tokensvc.document_write_state(ns text, kb text, doc text, migration uuid,
    OUT generation integer, OUT dual_write boolean, OUT version bigint, OUT content_sha256 bytea)
LANGUAGE plpgsql SECURITY INVOKER SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
BEGIN
    generation := tokensvc.knowledge_base_generation(ns, kb);
    SELECT d.version, d.content_sha256 INTO version, content_sha256 FROM tokensvc.documents d
    WHERE d.namespace = ns AND d.kb_ref = kb AND d.ref = doc FOR UPDATE;
    dual_write := migration IS NOT NULL AND EXISTS (
        SELECT 1 FROM tokensvc.embedding_migrations m
        WHERE m.id = migration AND m.namespace = ns AND m.kb_ref = kb AND m.state = 'backfilling');
END $$;
REVOKE ALL ON FUNCTION tokensvc.document_write_state(text,text,text,uuid) FROM PUBLIC, {runner_role};
GRANT EXECUTE ON FUNCTION tokensvc.document_write_state(text,text,text,uuid) TO {app_role};
