"""The domain error tree: what domain and storage code raise. No transport, no database driver.

Every error carries a stable `Reason` (mirrored by the proto's `ErrorReason`) and a message that
is safe to show to the caller. Nothing here knows a status code: the one table mapping reasons to
gRPC status codes is `tokensvc.api.status`. Database failures are translated into these errors by
exception class where the database is called (`tokensvc.storage.postgres.errors`).
"""

from __future__ import annotations

import enum

__all__ = [
    "AlreadyExists",
    "CapabilityExpired",
    "CapabilityInvalid",
    "CapabilityMissing",
    "CapabilityRevoked",
    "ConcurrencyLimit",
    "ConcurrentChange",
    "DatabaseRefused",
    "DatabaseUnavailable",
    "DeadlineExceeded",
    "EmbedderUnavailable",
    "InvalidArgument",
    "NotFound",
    "NotImplementedRpc",
    "PayloadTooLarge",
    "PermissionDenied",
    "PinnedConfiguration",
    "Reason",
    "TokensvcError",
    "Unauthenticated",
]


class Reason(enum.StrEnum):
    """Stable error reasons; mirrors `tokensvc.v1.ErrorReason` without its prefix (a test checks)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    PINNED_CONFIGURATION = "PINNED_CONFIGURATION"
    NOT_IMPLEMENTED = "NOT_IMPLEMENTED"
    CAPABILITY_MISSING = "CAPABILITY_MISSING"
    CAPABILITY_INVALID = "CAPABILITY_INVALID"
    CAPABILITY_EXPIRED = "CAPABILITY_EXPIRED"
    CAPABILITY_REVOKED = "CAPABILITY_REVOKED"
    CALLER_IDENTITY_INVALID = "CALLER_IDENTITY_INVALID"
    BINDING_MISMATCH = "BINDING_MISMATCH"
    ROLE_NOT_ALLOWED = "ROLE_NOT_ALLOWED"
    SCOPE_NOT_GRANTED = "SCOPE_NOT_GRANTED"
    SIGNING_KEY_NOT_CONFIGURED = "SIGNING_KEY_NOT_CONFIGURED"
    PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"
    DATABASE_UNAVAILABLE = "DATABASE_UNAVAILABLE"
    EMBEDDER_UNAVAILABLE = "EMBEDDER_UNAVAILABLE"
    ROTATION_IN_PROGRESS = "ROTATION_IN_PROGRESS"
    ROTATION_FAILED = "ROTATION_FAILED"
    MIGRATION_CONFLICT = "MIGRATION_CONFLICT"
    CREDENTIAL_INVALID = "CREDENTIAL_INVALID"
    TRUST_BUNDLE_INVALID = "TRUST_BUNDLE_INVALID"
    CONCURRENCY_LIMIT = "CONCURRENCY_LIMIT"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    INTERNAL = "INTERNAL"


class TokensvcError(Exception):
    """Base of every deliberate error. `message` is safe to show to the caller."""

    reason: Reason = Reason.INTERNAL

    def __init__(self, message: str, *, reason: Reason | None = None, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        if reason is not None:
            self.reason = reason


class InvalidArgument(TokensvcError):
    """A request field is malformed or out of range; `field` names it (a path like `items[3].content`)."""

    reason = Reason.INVALID_ARGUMENT

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}", field=field)


class PayloadTooLarge(InvalidArgument):
    reason = Reason.PAYLOAD_TOO_LARGE


class NotFound(TokensvcError):
    reason = Reason.NOT_FOUND


class AlreadyExists(TokensvcError):
    reason = Reason.ALREADY_EXISTS


class PinnedConfiguration(TokensvcError):
    """A pinned choice (embedder, dimension, chunking) would change; that needs re-embedding."""

    reason = Reason.PINNED_CONFIGURATION


class NotImplementedRpc(TokensvcError):
    reason = Reason.NOT_IMPLEMENTED


class Unauthenticated(TokensvcError):
    """The caller or its capability is not accepted. Messages never say which check failed."""

    reason = Reason.CAPABILITY_INVALID

    def __init__(self, reason: Reason | None = None):
        reason = reason or self.reason
        what = "caller certificate" if reason is Reason.CALLER_IDENTITY_INVALID else "run capability"
        super().__init__(f"the {what} was not accepted", reason=reason)


class CapabilityMissing(Unauthenticated):
    reason = Reason.CAPABILITY_MISSING


class CapabilityInvalid(Unauthenticated):
    reason = Reason.CAPABILITY_INVALID


class CapabilityExpired(Unauthenticated):
    reason = Reason.CAPABILITY_EXPIRED


class CapabilityRevoked(Unauthenticated):
    reason = Reason.CAPABILITY_REVOKED


class PermissionDenied(TokensvcError):
    """Binding, role or scope refused; the stable reason is the only detail given."""

    reason = Reason.ROLE_NOT_ALLOWED

    def __init__(self, reason: Reason):
        super().__init__("the caller is not permitted to do this", reason=reason)


class DatabaseUnavailable(TokensvcError):
    reason = Reason.DATABASE_UNAVAILABLE

    def __init__(self, message: str = "the database is unavailable; retry later"):
        super().__init__(message)


class ConcurrentChange(DatabaseUnavailable):
    """The database rolled the transaction back for a conflict with another one (a deadlock, a
    serialization failure): nothing of it was written, so it may be run again as it was."""

    def __init__(self, message: str = "a concurrent change conflicted with this one; retry"):
        super().__init__(message)


class EmbedderUnavailable(TokensvcError):
    reason = Reason.EMBEDDER_UNAVAILABLE


class ConcurrencyLimit(TokensvcError):
    reason = Reason.CONCURRENCY_LIMIT


class DeadlineExceeded(TokensvcError):
    reason = Reason.DEADLINE_EXCEEDED


class DatabaseRefused(TokensvcError):
    """The database refused a statement for a reason no other error names (a privilege, a check).

    `kind` is the SQLSTATE class's name (e.g. `InsufficientPrivilegeError`), never the server's
    message text, which can quote the statement's values.
    """

    reason = Reason.INTERNAL

    def __init__(self, kind: str):
        super().__init__(f"the database refused the statement ({kind})")
        self.kind = kind
