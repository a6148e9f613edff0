"""The one status table: domain errors -> gRPC status codes, sent with `google.rpc.ErrorInfo`.

Domain and storage code raise `tokensvc.errors` and never see a status code; the edge interceptor
calls `status_for` for every exception that escapes a servicer. Known errors keep their message
and stable reason. Database failures arrive here already translated into domain errors (by
exception class, in `tokensvc.storage.postgres.errors`), so this module knows no database driver.
Anything else becomes INTERNAL with a generic message; the detail goes to the log under the
request id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from tokensvc.errors import NotImplementedRpc, Reason, TokensvcError

__all__ = [
    "ERROR_DOMAIN",
    "StatusInfo",
    "abort_with",
    "rich_status",
    "status_code_for_reason",
    "status_for",
]

ERROR_DOMAIN = "tokensvc.ctxmesh.ai"

# Error messages and field paths longer than this are cut (see rich_status).
_MAX_MESSAGE_CHARS = 512
_MAX_FIELD_CHARS = 256

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
    Reason.MIGRATION_CONFLICT: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.CREDENTIAL_INVALID: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.TRUST_BUNDLE_INVALID: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.CONCURRENCY_LIMIT: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    Reason.INTERNAL: grpc.StatusCode.INTERNAL,
}


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


def _bounded(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def rich_status(info: StatusInfo, request_id: str) -> grpc.Status:
    """A grpc.Status whose details carry ErrorInfo (and BadRequest when a field is named).

    Messages and field paths may quote the caller's input; they are cut short so the status
    trailers stay far below the 16 KiB metadata limit of gRPC clients (over it, the client sees
    RESOURCE_EXHAUSTED instead of this status).
    """
    message = _bounded(info.message, _MAX_MESSAGE_CHARS)
    field = _bounded(info.field, _MAX_FIELD_CHARS) if info.field else None
    metadata = {"request_id": request_id}
    if field:
        metadata["field"] = field
    details = [
        _pack(error_details_pb2.ErrorInfo(reason=info.reason.value, domain=ERROR_DOMAIN, metadata=metadata))
    ]
    if field:
        violation = error_details_pb2.BadRequest.FieldViolation(field=field, description=message)
        details.append(_pack(error_details_pb2.BadRequest(field_violations=[violation])))
    status = status_pb2.Status(code=info.code.value[0], message=message, details=details)
    return rpc_status.to_status(status)


def _pack(message: Any) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


async def abort_with(context: grpc.aio.ServicerContext[Any, Any], info: StatusInfo, request_id: str) -> None:
    status = rich_status(info, request_id)
    await context.abort(status.code, status.details, status.trailing_metadata)
