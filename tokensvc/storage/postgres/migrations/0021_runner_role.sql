-- The re-embedding runner gets a role of its own, and the serving role loses every path to rows
-- outside the buckets its transaction declared (issue 35, finding F12).
--
-- Before: the serving role could INSERT and UPDATE `embedding_migrations` (no row-level security),
-- and the runner's SECURITY DEFINER functions trust that row (its space, slot, dimension, lease):
-- a forged `backfilling` row made migration_pending hand out every bucket id and memory of a
-- space, migration_store + cut_over_memory_space re-pinned a space, a forged `retiring` row made
-- migration_clear empty the slot a live space reads. Now:
--
-- * the serving role may only read the table (not the backfill cursor, which holds a bucket id),
--   and creates and moves migrations through functions that check their input: the subject the
--   transaction declared and its current pin (the source is read, never taken from the caller),
--   a whole target (never the built-in `hash` embedder for a subject pinned to another: it is for
--   tests, and always configured), and the operator's transitions of the state machine only
--   (cancel, resume, a start's release), each for the subject its transaction declared;
-- * the runner's functions (claim, lease, batches, clean-up, cutover, finish) are executable by
--   the runner group role `{runner_role}` only, whose login role the service's runner pool uses
--   (its own credential); migration_pending answers only a transaction that declared the space;
-- * the HNSW builds the serving role may ask for are limited to dimensions something uses, and
--   to 16 distinct dimensions in all (a pin the serving role inserts makes a dimension "used").
--
-- `{runner_role}` is substituted like `{app_role}` (a validated identifier); the group role is
-- created by whoever provisions roles (docs/operations.md, "The runner credential"), as the
-- serving group is: the schema owner need not be able to create roles.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{runner_role}') THEN
        RAISE EXCEPTION 'role {runner_role} does not exist: create it first (CREATE ROLE {runner_role} NOLOGIN, '
            'and a login role in it; docs/operations.md, "The runner credential")'
            USING ERRCODE = '42704';
    END IF;
    -- The runner's login connects like the serving one. The schema owner may not own the database
    -- (then the DBA grants CONNECT, as for the serving group).
    BEGIN
        EXECUTE format('GRANT CONNECT ON DATABASE %I TO {runner_role}', current_database());
    EXCEPTION WHEN insufficient_privilege THEN
        RAISE NOTICE 'grant CONNECT on database % to {runner_role} as its owner', current_database();
    END;
END $$;

GRANT USAGE ON SCHEMA tokensvc TO {runner_role};
GRANT SELECT ON tokensvc.schema_migrations TO {runner_role};
GRANT SELECT ON tokensvc.embedding_migrations TO {runner_role};

-- The serving role reads migrations (status, list, the gauges, an upload's dual write) and writes
-- none: every column but the backfill cursor, whose bucket id only the runner may know.
REVOKE INSERT, UPDATE, SELECT ON tokensvc.embedding_migrations FROM {app_role};
GRANT SELECT (id, namespace, agent, kb_ref, from_generation, from_embedder, from_model, from_dimension,
              to_embedder, to_model, to_dimension, to_normalized, from_chunking, from_chunk_size,
              from_chunk_overlap, to_chunking, to_chunk_size, to_chunk_overlap, state, reason, rows_total,
              rows_done, failures, lease_owner, lease_until, created_by, created_at, updated_at,
              cut_over_at, finished_at, cursor_document)
    ON tokensvc.embedding_migrations TO {app_role};
-- A pinned space is never re-pinned by the serving role: UPDATE was revoked in 0003, and a DELETE
-- followed by an INSERT would do the same (the service never deletes a space). The privilege
-- stays (on Citus every INSERT into a reference table locks its other placements with
-- lock_shard_resources, which requires UPDATE, DELETE or TRUNCATE on the table: Citus's
-- resource_lock.c); instead, the tenant policy is split by command and none allows a DELETE, so no
-- row can be deleted by anyone but a superuser. (A RESTRICTIVE policy would do on one node, but
-- Citus creates it on the shards as a permissive one.) The owner's re-pin at a cutover keeps its
-- UPDATE policy; the serving role has no UPDATE privilege.
DROP POLICY memory_spaces_tenant ON tokensvc.memory_spaces;
CREATE POLICY memory_spaces_tenant_read ON tokensvc.memory_spaces FOR SELECT
    USING (namespace = current_setting('tokensvc.namespace', true)
           AND agent = current_setting('tokensvc.agent', true));
CREATE POLICY memory_spaces_tenant_pin ON tokensvc.memory_spaces FOR INSERT
    WITH CHECK (namespace = current_setting('tokensvc.namespace', true)
                AND agent = current_setting('tokensvc.agent', true));
CREATE POLICY memory_spaces_tenant_repin ON tokensvc.memory_spaces FOR UPDATE
    USING (namespace = current_setting('tokensvc.namespace', true)
           AND agent = current_setting('tokensvc.agent', true))
    WITH CHECK (namespace = current_setting('tokensvc.namespace', true)
                AND agent = current_setting('tokensvc.agent', true));

-- The owner reads every knowledge base's pin for ensure_chunk_vector_index only (as 0016 lets it
-- list memory spaces): tenant queries' row-level security is unchanged.
DO $$
BEGIN
    EXECUTE format('CREATE POLICY knowledge_bases_owner_listing ON tokensvc.knowledge_bases FOR SELECT TO %I '
                   'USING (true)', current_user);
END $$;
