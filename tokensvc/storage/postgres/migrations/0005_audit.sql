-- The audit trail: who (SPIFFE ID) did what, when, with which outcome. Append-only for the
-- serving role; never holds a secret, token or user id.
CREATE TABLE tokensvc.audit_events (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    occurred_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    kind        text        NOT NULL,
    actor       text        NOT NULL,
    action      text        NOT NULL,
    target      text        NOT NULL DEFAULT '',
    outcome     text        NOT NULL CHECK (outcome IN ('started', 'succeeded', 'failed', 'denied')),
    reason      text        NOT NULL DEFAULT '',
    detail      text        NOT NULL DEFAULT '' CHECK (length(detail) <= 2048)
);
CREATE INDEX audit_events_time ON tokensvc.audit_events (occurred_at DESC, id DESC);
CREATE INDEX audit_events_kind ON tokensvc.audit_events (kind, occurred_at DESC);
REVOKE UPDATE, DELETE, TRUNCATE ON tokensvc.audit_events FROM {app_role};
