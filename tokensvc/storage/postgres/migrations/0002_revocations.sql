-- Revoked capabilities, by token id (jti) or by run id (sub). Every replica polls this table, so a
-- revocation made anywhere is honoured everywhere within the poll interval.
CREATE TABLE tokensvc.capability_revocations (
    kind       text        NOT NULL CHECK (kind IN ('jti', 'run')),
    value      text        NOT NULL CHECK (length(value) BETWEEN 1 AND 256),
    reason     text        NOT NULL DEFAULT '' CHECK (length(reason) <= 1024),
    revoked_by text        NOT NULL,
    revoked_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (kind, value)
);
CREATE INDEX capability_revocations_revoked_at ON tokensvc.capability_revocations (revoked_at);
-- Revocations are facts: the service adds them and never edits or deletes them.
REVOKE UPDATE, DELETE ON tokensvc.capability_revocations FROM {app_role};
