-- A chunk's vector stays in its row (issue 37, "Speed"). A 256-word chunk's row holds its text,
-- its tsvector and a 384-d vector (1.5 kB each); past 2 kB PostgreSQL's toaster moved the vector
-- out of line, so an exact search (a base up to 5,000 chunks) read every vector through the TOAST
-- index: 8,156 buffers and 9.2 ms for 2,500 chunks, 640 buffers and 4.1 ms with the vectors in
-- the row. MAIN: compressed or moved out only when nothing else makes the row fit (a vector too
-- big for a page still can be); the text and tsvector go out of line first.
--
-- Rows written before this keep their layout until they are written again (a new version, a
-- re-embedding migration); searches are correct either way.
--
-- On Citus a distributed table's ALTER COLUMN ... SET STORAGE is not forwarded: each shard is
-- altered, then the coordinator's table (whose definition new shards copy).
DO $$
BEGIN
    IF to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL THEN
        IF EXISTS (SELECT FROM pg_catalog.pg_dist_partition WHERE logicalrelid = 'tokensvc.chunks'::regclass) THEN
            PERFORM run_command_on_shards(
                'tokensvc.chunks', 'ALTER TABLE %s ALTER COLUMN embedding SET STORAGE MAIN'
            );
            SET LOCAL citus.enable_ddl_propagation = off;
            ALTER TABLE tokensvc.chunks ALTER COLUMN embedding SET STORAGE MAIN;
            SET LOCAL citus.enable_ddl_propagation = on;
            RETURN;
        END IF;
    END IF;
    ALTER TABLE tokensvc.chunks ALTER COLUMN embedding SET STORAGE MAIN;
END
$$;
