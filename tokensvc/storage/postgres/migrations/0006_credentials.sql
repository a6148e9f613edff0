-- Credential custody: the rotation journal (a write-ahead log, like Vault's: each step is written
-- before it is taken, so a crash at any step rolls forward or back on restart) and aggregate
-- statistics the serving role may read without seeing any tenant's rows.

CREATE TABLE tokensvc.credential_rotations (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    mode         text        NOT NULL CHECK (mode IN ('reload', 'rotate')),
    actor        text        NOT NULL,
    from_role    text        NOT NULL,
    to_role      text        NOT NULL,
    step         text        NOT NULL,
    outcome      text        NOT NULL CHECK (outcome IN ('in_progress', 'succeeded', 'failed', 'recovered')),
    reason       text        NOT NULL DEFAULT '',
    -- The credential version in force after this rotation (set when it succeeds or recovers).
    version      bigint,
    started_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at   timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX credential_rotations_open ON tokensvc.credential_rotations (id) WHERE outcome = 'in_progress';
REVOKE DELETE, TRUNCATE ON tokensvc.credential_rotations FROM {app_role};

-- Rows per pepper version, across every bucket. Runs as the owner, whom a dedicated policy lets
-- read memories for this aggregate only; callers get counts, never rows.
DO $$
BEGIN
    EXECUTE format('CREATE POLICY memories_owner_statistics ON tokensvc.memories FOR SELECT TO %I USING (true)',
                   current_user);
END $$;
