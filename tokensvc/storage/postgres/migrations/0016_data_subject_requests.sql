-- End-user data rights (issue 17): erasure and export of one end-user's memories across every
-- agent of a namespace (or of every namespace), with a receipt.
--
-- The raw user id never reaches the database: the service computes the user's bucket under
-- every pepper version and works through those buckets with the tables' own row-level security
-- (it declares them as the transaction's buckets). What the database needs from the owner is the
-- list of agents, which no tenant may read across agents.

-- The owner reads every space for this function only (the policy names the owner: tenant
-- queries' row-level security is unchanged).
DO $$
BEGIN
    EXECUTE format('CREATE POLICY memory_spaces_owner_listing ON tokensvc.memory_spaces FOR SELECT TO %I '
                   'USING (true)', current_user);
END $$;

-- One row per erasure or export: what was done, never whose (no user id, no bucket, no content).
CREATE TABLE tokensvc.data_subject_receipts (
    id          uuid        PRIMARY KEY,
    kind        text        NOT NULL CHECK (kind IN ('erasure', 'export')),
    namespace   text        NOT NULL,  -- '' for every namespace
    memories    bigint      NOT NULL CHECK (memories >= 0),
    -- [{"namespace": ..., "agent": ..., "memories": n}, ...] for the agents with any
    per_agent   jsonb       NOT NULL DEFAULT '[]'::jsonb,
    agents      integer     NOT NULL CHECK (agents >= 0),  -- agents looked at
    key_prefixes integer    NOT NULL CHECK (key_prefixes >= 0),  -- session-memory prefixes listed
    actor       text        NOT NULL,
    -- false: an erasure cut off part of the way (the deadline, a failure); it is run again
    complete    boolean     NOT NULL DEFAULT true,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
-- A receipt is evidence: the serving role records and reads it, never changes or removes it.
REVOKE UPDATE, DELETE, TRUNCATE ON tokensvc.data_subject_receipts FROM {app_role};
