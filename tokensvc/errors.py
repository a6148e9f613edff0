"""The domain error tree and the one table that maps it to gRPC status codes.

Domain and storage code raise `TokensvcError` subclasses and never see a status code. The API
edge calls `status_for` for every error that escapes a servicer: known errors keep their message
and stable reason; database errors are translated by exception class (asyncpg's SQLSTATE classes,
never message text); anything else becomes INTERNAL with a generic message, and the detail goes
to the log under the request id.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass

import asyncpg
import grpc

__all__ = [
    "ERROR_DOMAIN",
    "AlreadyExists",
    "CapabilityExpired",
    "CapabilityInvalid",
    "CapabilityMissing",
    "CapabilityRevoked",
    "ConcurrencyLimit",
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
    "StatusInfo",
    "TokensvcError",
    "Unauthenticated",
    "status_for",
]

ERROR_DOMAIN = "tokensvc.ctxmesh.ai"


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


class EmbedderUnavailable(TokensvcError):
    reason = Reason.EMBEDDER_UNAVAILABLE


class ConcurrencyLimit(TokensvcError):
    reason = Reason.CONCURRENCY_LIMIT


class DeadlineExceeded(TokensvcError):
    reason = Reason.DEADLINE_EXCEEDED


# The one table: reason -> status code. Every Reason appears exactly once (a test checks).
_STATUS_BY_REASON: dict[Reason, grpc.StatusCode] = {
    Reason.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.PAYLOAD_TOO_LARGE: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Reason.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    Reason.PINNED_CONFIGURATION: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.NOT_IMPLEMENTED: grpc.StatusCode.UNIMPLEMENTED,
    Reason.CAPABILITY_MISSING: grpc.StatusCode.UNAUTHENTICATED,
    Reason.CAPABILITY_INVALID: grpc.StatusCode.UNAUTHENTICATED,
    Reason.CAPABILITY_EXPIRED: grpc.StatusCode.UNAUTHENTICATED,
    Reason.CAPABILITY_REVOKED: grpc.StatusCode.UNAUTHENTICATED,
    Reason.CALLER_IDENTITY_INVALID: grpc.StatusCode.UNAUTHENTICATED,
    Reason.BINDING_MISMATCH: grpc.StatusCode.PERMISSION_DENIED,
    Reason.ROLE_NOT_ALLOWED: grpc.StatusCode.PERMISSION_DENIED,
    Reason.SCOPE_NOT_GRANTED: grpc.StatusCode.PERMISSION_DENIED,
    Reason.SIGNING_KEY_NOT_CONFIGURED: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.DATABASE_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Reason.EMBEDDER_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Reason.ROTATION_IN_PROGRESS: grpc.StatusCode.ABORTED,
    Reason.ROTATION_FAILED: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.CREDENTIAL_INVALID: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.TRUST_BUNDLE_INVALID: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.CONCURRENCY_LIMIT: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    Reason.INTERNAL: grpc.StatusCode.INTERNAL,
}

# Database failures by exception class: the connection is gone or cannot be made.
_DATABASE_UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    asyncpg.PostgresConnectionError,
    asyncpg.CannotConnectNowError,
    asyncpg.TooManyConnectionsError,
    asyncpg.InterfaceError,
    # The server ended the connection between two operations (its FATAL arrived while the
    # connection sat idle) and the next one, often the pool's reset on release, finds the protocol
    # mid-error (MagicStack/asyncpg#784). The pool has already terminated that connection.
    asyncpg.InternalClientError,
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
    ConnectionError,
    OSError,
    asyncio.TimeoutError,
)


@dataclass(frozen=True)
class StatusInfo:
    """What the API edge sends: a status code, a safe message, a reason and the offending field."""

    code: grpc.StatusCode
    message: str
    reason: Reason
    field: str | None = None
    internal: bool = False


def status_for(exc: BaseException) -> StatusInfo:
    """Map any exception to what the caller sees. Unknown errors are INTERNAL and generic."""
    if isinstance(exc, TokensvcError):
        return StatusInfo(_STATUS_BY_REASON[exc.reason], exc.message, exc.reason, exc.field)
    if isinstance(exc, asyncpg.QueryCanceledError):
        return StatusInfo(
            _STATUS_BY_REASON[Reason.DEADLINE_EXCEEDED],
            "the operation was cancelled before it finished",
            Reason.DEADLINE_EXCEEDED,
        )
    if isinstance(exc, _DATABASE_UNAVAILABLE_ERRORS):
        return status_for(DatabaseUnavailable())
    if isinstance(exc, NotImplementedError):
        return status_for(NotImplementedRpc("this RPC is not implemented yet"))
    return StatusInfo(
        _STATUS_BY_REASON[Reason.INTERNAL],
        "internal error; quote the request id to the operator",
        Reason.INTERNAL,
        internal=True,
    )


def status_code_for_reason(reason: Reason) -> grpc.StatusCode:
    return _STATUS_BY_REASON[reason]
