-- An upload's document row is locked FOR UPDATE by the serving role itself (issue 19).
--
-- 0015's document_write_state ran as the owner, so the row lock belonged to the owner. On one
-- node that is the same backend as the serving role's next statement. On Citus it is not: the
-- coordinator opens a worker connection per role, so the owner's lock was held by one worker
-- backend and the serving role's UPDATE (or its chunks' foreign-key check) waited on it from
-- another, inside the same distributed transaction: a deadlock Citus cancels.
--
-- The serving role may update documents (0001's grants), so it may lock them; row-level security
-- scopes the lock to its declared tenant as before. The base row is still read FOR SHARE as the
-- owner (knowledge_base_generation, 0015): the serving role may not update knowledge_bases, and an
-- upload never writes that row, so nothing of the upload waits on that lock. The lock order is
-- unchanged: the base row, then the document row.
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
