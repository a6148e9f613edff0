"""proto <-> domain conversions shared by servicers (no logic beyond the mapping)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from google.protobuf import duration_pb2, timestamp_pb2

from tokensvc.api.context import current_call
from tokensvc.auth.scope import TenantScope
from tokensvc.auth.session_keys import SessionScope
from tokensvc.errors import InvalidArgument
from tokensvc.retrieval import SearchMode
from tokensvc.v1 import capability_pb2, common_pb2

__all__ = [
    "current_scope",
    "decode_search_mode",
    "decode_uuid",
    "duration_seconds",
    "scope_to_proto",
    "session_scope_from_proto",
    "session_scope_to_proto",
    "set_timestamp",
    "timestamp",
]


def current_scope() -> TenantScope:
    """The verified tenant scope of the current call (the edge put it there)."""
    scope = current_call().capability
    assert isinstance(scope, TenantScope), "RPC policy must require a capability"
    return scope


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_Timestamp = timestamp_pb2.Timestamp


def timestamp(value: datetime | int | float) -> timestamp_pb2.Timestamp:
    """A Timestamp from an aware datetime (a naive one is local time) or epoch seconds.

    Built from whole seconds and nanoseconds since the epoch in one constructor call: a search
    answer carries two or three per hit, and `Timestamp.FromDatetime` (time tuples, `timegm`)
    cost ~4x as much.
    """
    if isinstance(value, datetime):
        since = (value if value.tzinfo is not None else value.astimezone(UTC)) - _EPOCH
        return _Timestamp(seconds=since.days * 86_400 + since.seconds, nanos=since.microseconds * 1000)
    return _Timestamp(seconds=int(value))


def set_timestamp(target: timestamp_pb2.Timestamp, value: datetime) -> None:
    """Write an aware datetime into a message's Timestamp field in place (no message copied)."""
    since = value - _EPOCH
    target.seconds = since.days * 86_400 + since.seconds
    target.nanos = since.microseconds * 1000


def duration_seconds(value: duration_pb2.Duration, field: str) -> int:
    if value.nanos or value.seconds < 0:
        raise InvalidArgument(field, "must be a whole, non-negative number of seconds")
    return int(value.seconds)


def scope_to_proto(scope: TenantScope) -> capability_pb2.CapabilityScope:
    return capability_pb2.CapabilityScope(
        namespace=scope.namespace,
        agent=scope.agent,
        bucket_id=scope.bucket_id,
        per_user=scope.per_user,
        registry=scope.registry or "",
        long_term_memory=scope.long_term_memory,
        knowledge_bases=list(scope.knowledge_bases),
        run_id=scope.run_id,
        jti=scope.jti,
        issued_at=timestamp(scope.issued_at),
        expires_at=timestamp(scope.expires_at),
    )


_SESSION_SCOPES = {
    capability_pb2.SESSION_SCOPE_UNSPECIFIED: SessionScope.SESSION,
    capability_pb2.SESSION_SCOPE_SESSION: SessionScope.SESSION,
    capability_pb2.SESSION_SCOPE_SHARED: SessionScope.SHARED,
}


def session_scope_from_proto(value: int) -> SessionScope:
    try:
        return _SESSION_SCOPES[value]  # type: ignore[index]
    except KeyError:
        raise InvalidArgument("scope", "must be SESSION_SCOPE_SESSION or SESSION_SCOPE_SHARED") from None


def session_scope_to_proto(scope: SessionScope) -> capability_pb2.SessionScope.ValueType:
    if scope is SessionScope.SHARED:
        return capability_pb2.SESSION_SCOPE_SHARED
    return capability_pb2.SESSION_SCOPE_SESSION


_SEARCH_MODES = {
    common_pb2.SEARCH_MODE_VECTOR: SearchMode.VECTOR,
    common_pb2.SEARCH_MODE_TEXT: SearchMode.TEXT,
    common_pb2.SEARCH_MODE_HYBRID: SearchMode.HYBRID,
}


def decode_search_mode(value: int, *, has_text: bool) -> SearchMode:
    """The request's mode; UNSPECIFIED is HYBRID for a text query, VECTOR for a query vector."""
    if value == common_pb2.SEARCH_MODE_UNSPECIFIED:
        return SearchMode.HYBRID if has_text else SearchMode.VECTOR
    mode: SearchMode | None = _SEARCH_MODES.get(value)  # type: ignore[call-overload]
    if mode is None:
        raise InvalidArgument("mode", "must be SEARCH_MODE_VECTOR, SEARCH_MODE_TEXT or SEARCH_MODE_HYBRID")
    if mode is not SearchMode.VECTOR and not has_text:
        raise InvalidArgument("mode", f"{mode.name} needs query_text (full-text search cannot use a vector)")
    return mode


def decode_uuid(value: str, field: str, what: str) -> str:
    """An id that is a UUID, in its canonical form; INVALID_ARGUMENT naming `field` otherwise."""
    try:
        if len(value) <= 64:
            return str(uuid.UUID(value))
    except (ValueError, AttributeError):
        pass
    raise InvalidArgument(field, f"must be {what} (a UUID)")
