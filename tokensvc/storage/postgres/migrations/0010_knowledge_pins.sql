-- A knowledge search that embedded its query with the pins it remembered (which bases of the
-- roster exist, each with its creation time) checks them as its transaction starts, in the same
-- message: it fails with SQLSTATE TS001 when a base was created, deleted or re-created since, and
-- the caller re-reads the pins and searches again. So a search never mixes a stale embedder's
-- query with another corpus's vectors, and costs no extra round trip when the pins hold.
-- SECURITY INVOKER: it sees only what the transaction's declared tenant may see.
CREATE FUNCTION tokensvc.expect_knowledge_bases(roster text[], refs text[], created timestamptz[])
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
GRANT EXECUTE ON FUNCTION tokensvc.expect_knowledge_bases(text[], text[], timestamptz[]) TO {app_role};
