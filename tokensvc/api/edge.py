"""The server interceptor every RPC passes through.

For each call, in order: a request id; the caller's identity from its client certificate; the
role check from `policy.POLICIES`; the run capability when the RPC needs one; then the servicer
runs with a `CallContext`. Any exception that escapes becomes a status through `errors.status_for`
(the one table), sent with `google.rpc.ErrorInfo` (and `BadRequest` for field errors); internal
errors are logged with the request id and answered with a generic message.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Protocol, cast

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from tokensvc.api.context import CallContext, reset_call, use_call
from tokensvc.api.policy import POLICIES, RpcPolicy
from tokensvc.auth.identity import Caller, IdentityPolicy, caller_from_auth_context
from tokensvc.errors import (
    ERROR_DOMAIN,
    CapabilityMissing,
    NotImplementedRpc,
    PermissionDenied,
    Reason,
    StatusInfo,
    status_for,
)

__all__ = ["CapabilityAuthenticator", "EdgeInterceptor", "abort_with"]

_log = logging.getLogger("tokensvc.rpc")
_REQUEST_ID_KEY = "x-request-id"
_AUTHORIZATION_KEY = "authorization"
_MAX_REQUEST_ID = 64


class CapabilityAuthenticator(Protocol):
    """Verifies a bearer capability for a caller; raises Unauthenticated/PermissionDenied."""

    async def authenticate(self, token: str, caller: Caller) -> Any: ...


def _request_id(metadata: tuple[tuple[str, str | bytes], ...]) -> str:
    for key, value in metadata:
        if key == _REQUEST_ID_KEY and isinstance(value, str):
            cleaned = "".join(ch for ch in value[:_MAX_REQUEST_ID] if ch.isalnum() or ch in "-_.")
            if cleaned:
                return cleaned
    return uuid.uuid4().hex


def _bearer(metadata: tuple[tuple[str, str | bytes], ...]) -> str | None:
    values = [value for key, value in metadata if key == _AUTHORIZATION_KEY]
    if len(values) != 1 or not isinstance(values[0], str):
        return None
    scheme, _, token = values[0].partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def rich_status(info: StatusInfo, request_id: str) -> grpc.Status:
    """A grpc.Status whose details carry ErrorInfo (and BadRequest when a field is named)."""
    metadata = {"request_id": request_id}
    if info.field:
        metadata["field"] = info.field
    details = [
        _pack(error_details_pb2.ErrorInfo(reason=info.reason.value, domain=ERROR_DOMAIN, metadata=metadata))
    ]
    if info.field:
        violation = error_details_pb2.BadRequest.FieldViolation(field=info.field, description=info.message)
        details.append(_pack(error_details_pb2.BadRequest(field_violations=[violation])))
    status = status_pb2.Status(code=info.code.value[0], message=info.message, details=details)
    return rpc_status.to_status(status)


def _pack(message: Any) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


async def abort_with(context: grpc.aio.ServicerContext[Any, Any], info: StatusInfo, request_id: str) -> None:
    status = rich_status(info, request_id)
    await context.abort(status.code, status.details, status.trailing_metadata)


class EdgeInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    def __init__(
        self,
        identities: IdentityPolicy,
        authenticator: CapabilityAuthenticator | None,
        policies: Mapping[str, RpcPolicy] = POLICIES,
    ):
        self._identities = identities
        self._authenticator = authenticator
        self._policies = policies

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        metadata = tuple(handler_call_details.invocation_metadata or ())
        if handler is None:
            # An unknown method still gets a request id and an ErrorInfo reason, like every error.
            return grpc.unary_unary_rpc_method_handler(_Call(self, method, metadata, None).unknown_method)
        policy = self._policies.get(method)
        edge = _Call(self, method, metadata, policy)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                edge.wrap_unary(handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                edge.wrap_unary(handler.stream_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                edge.wrap_stream(cast(Any, handler.unary_stream)),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return grpc.stream_stream_rpc_method_handler(
            edge.wrap_stream(cast(Any, handler.stream_stream)),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    async def admit(
        self,
        method: str,
        policy: RpcPolicy | None,
        metadata: tuple[tuple[str, Any], ...],
        context: Any,
        request_id: str,
    ) -> CallContext:
        """Identity, role, capability: raise on the first refusal."""
        caller = caller_from_auth_context(context.auth_context(), self._identities)
        if policy is None:
            raise PermissionDenied(Reason.ROLE_NOT_ALLOWED)
        if not policy.any_authenticated_peer and not caller.roles & policy.roles:
            raise PermissionDenied(Reason.ROLE_NOT_ALLOWED)
        capability = None
        if policy.needs_capability:
            token = _bearer(metadata)
            if token is None:
                raise CapabilityMissing()
            if self._authenticator is None:
                raise PermissionDenied(Reason.SCOPE_NOT_GRANTED)
            capability = await self._authenticator.authenticate(token, caller)
        return CallContext(request_id=request_id, method=method, caller=caller, capability=capability)


class _Call:
    """One RPC's passage through the edge."""

    def __init__(
        self,
        edge: EdgeInterceptor,
        method: str,
        metadata: tuple[tuple[str, Any], ...],
        policy: RpcPolicy | None,
    ):
        self.edge = edge
        self.method = method
        self.metadata = metadata
        self.policy = policy
        self.request_id = _request_id(metadata)
        self.code = grpc.StatusCode.OK
        self.caller: str | None = None

    async def unknown_method(self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        started = time.perf_counter()
        try:
            await self._fail(context, NotImplementedRpc(f"{self.method} is not a method of this server"))
        finally:
            self._log(started)
        return b""  # unreachable: _fail aborts

    def wrap_unary(self, behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            started = time.perf_counter()
            try:
                call = await self.edge.admit(
                    self.method, self.policy, self.metadata, context, self.request_id
                )
                self.caller = call.caller.spiffe_id
                token = use_call(call)
                try:
                    return await behavior(request, context)
                finally:
                    reset_call(token)
            except Exception as exc:
                await self._fail(context, exc)
                raise  # unreachable: _fail aborts
            finally:
                self._log(started)

        return unary

    def wrap_stream(self, behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
        async def stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            started = time.perf_counter()
            try:
                call = await self.edge.admit(
                    self.method, self.policy, self.metadata, context, self.request_id
                )
                self.caller = call.caller.spiffe_id
                token = use_call(call)
                try:
                    async for response in behavior(request, context):
                        yield response
                finally:
                    reset_call(token)
            except Exception as exc:
                await self._fail(context, exc)
                raise  # unreachable: _fail aborts
            finally:
                self._log(started)

        return stream

    async def _fail(self, context: grpc.aio.ServicerContext[Any, Any], exc: Exception) -> None:
        if isinstance(exc, grpc.aio.AbortError):
            raise exc  # already answered (a servicer aborted deliberately)
        info = status_for(exc)
        self.code = info.code
        if info.internal:
            _log.error(
                "internal error",
                exc_info=exc,
                extra={"request_id": self.request_id, "method": self.method},
            )
        await abort_with(context, info, self.request_id)

    def _log(self, started: float) -> None:
        _log.info(
            "rpc",
            extra={
                "request_id": self.request_id,
                "method": self.method,
                "caller": self.caller,
                "status": self.code.name,
                "duration_ms": round((time.perf_counter() - started) * 1000, 3),
            },
        )
