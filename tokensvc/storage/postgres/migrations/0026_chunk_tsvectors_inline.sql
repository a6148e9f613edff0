-- A chunk's tsvector stays in its row too (issue 37, "Speed"), as its vector does (0025). The text
-- ranker reads the tsvector of every row matching a query word; out of line, each read was a TOAST
-- index lookup and a second heap read: on a 2,500-chunk base, ~14 ms of a 38 ms HYBRID statement.
-- MAIN keeps it in the row, compressed when that makes the row fit; only the text, which a search
-- reads for its results alone, goes out of line.
--
-- Rows written before this keep their layout until they are written again (a new version, a
-- re-embedding migration); searches are correct either way.
--
-- On Citus a distributed table's ALTER COLUMN ... SET STORAGE is not forwarded: each shard is
-- altered, then the coordinator's table (whose definition new shards copy), as in 0025.
DO $$
BEGIN
    IF to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL THEN
        IF EXISTS (SELECT FROM pg_catalog.pg_dist_partition WHERE logicalrelid = 'tokensvc.chunks'::regclass) THEN
            PERFORM run_command_on_shards(
                'tokensvc.chunks', 'ALTER TABLE %s ALTER COLUMN content_tsv SET STORAGE MAIN'
            );
            SET LOCAL citus.enable_ddl_propagation = off;
            ALTER TABLE tokensvc.chunks ALTER COLUMN content_tsv SET STORAGE MAIN;
            SET LOCAL citus.enable_ddl_propagation = on;
            RETURN;
        END IF;
    END IF;
    ALTER TABLE tokensvc.chunks ALTER COLUMN content_tsv SET STORAGE MAIN;
END
$$;
