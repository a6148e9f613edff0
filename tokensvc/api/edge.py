"""The server interceptor every RPC passes through.

For each call, in order: a request id; the caller's identity from its client certificate; the
role check from `policy.POLICIES`; the run capability when the RPC needs one; then the servicer
runs with a `CallContext`. Any exception that escapes becomes a status through `api.status.status_for`
(the one table), sent with `google.rpc.ErrorInfo` (and `BadRequest` for field errors); internal
errors are logged with the request id and answered with a generic message.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Protocol, cast

import grpc
from google.protobuf.message import DecodeError
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tokensvc.api.context import CallContext, reset_call, use_call
from tokensvc.api.policy import POLICIES, RpcPolicy
from tokensvc.api.status import abort_with, status_for
from tokensvc.auth.identity import Caller, CallerCache, IdentityPolicy
from tokensvc.auth.scope import TenantScope
from tokensvc.errors import (
    CapabilityMissing,
    ConcurrencyLimit,
    InvalidArgument,
    NotImplementedRpc,
    PermissionDenied,
    Reason,
    TokensvcError,
)
from tokensvc.observability.deadlines import reset_deadline, use_deadline
from tokensvc.observability.metrics import METRICS

__all__ = ["CapabilityAuthenticator", "EdgeInterceptor", "abort_with"]

_log = logging.getLogger("tokensvc.rpc")
_tracer = trace.get_tracer("tokensvc.rpc")
_TRACE_CONTEXT = TraceContextTextMapPropagator()
_REQUEST_ID_KEY = "x-request-id"
_AUTHORIZATION_KEY = "authorization"
_MAX_REQUEST_ID = 64
# A handler cancelled with less time than this left was cancelled by its deadline.
_DEADLINE_SLACK_SECONDS = 0.05


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


def _annotate(span: trace.Span, call: CallContext) -> None:
    """Tenant identifiers on the server span: never content, tokens or user ids."""
    span.set_attribute("tokensvc.caller", call.caller.spiffe_id)
    scope = call.capability
    if isinstance(scope, TenantScope):
        span.set_attribute("tokensvc.namespace", scope.namespace)
        span.set_attribute("tokensvc.agent", scope.agent)
        span.set_attribute("tokensvc.bucket", scope.bucket_id)


class _Undecodable:
    """Stands for request bytes that do not parse as the RPC's request message."""


_UNDECODABLE = _Undecodable()


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """The handler's deserializer, answering `_UNDECODABLE` instead of raising.

    gRPC would turn a parse error (corrupt wire bytes, or nesting past protobuf's depth limit)
    into UNKNOWN with the Python exception in the message; the edge answers INVALID_ARGUMENT,
    after admission, like every other malformed request.
    """
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError:
            return _UNDECODABLE

    return deserialize


def _decoded(request: Any) -> Any:
    """The request (or request stream) for the servicer; raises for bytes that did not parse."""
    if request is _UNDECODABLE:
        raise InvalidArgument("request", "is not a well-formed message of this RPC's request type")
    if hasattr(request, "__aiter__"):
        return _decoded_stream(request)
    return request


async def _decoded_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        yield _decoded(request)


def _bearer(metadata: tuple[tuple[str, str | bytes], ...]) -> str | None:
    values = [value for key, value in metadata if key == _AUTHORIZATION_KEY]
    if len(values) != 1 or not isinstance(values[0], str):
        return None
    scheme, _, token = values[0].partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class EdgeInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    def __init__(
        self,
        identities: IdentityPolicy,
        authenticator: CapabilityAuthenticator | None,
        policies: Mapping[str, RpcPolicy] = POLICIES,
        *,
        max_in_flight_per_caller: int = 64,
    ):
        self._callers = CallerCache(identities)
        self._authenticator = authenticator
        self._policies = policies
        self._max_in_flight = max_in_flight_per_caller
        self._in_flight: dict[str, int] = {}

    def enter(self, caller: str) -> None:
        """Take one of the caller's in-flight slots, or refuse with RESOURCE_EXHAUSTED."""
        count = self._in_flight.get(caller, 0)
        if count >= self._max_in_flight:
            raise ConcurrencyLimit(f"more than {self._max_in_flight} concurrent calls from this caller")
        self._in_flight[caller] = count + 1

    def leave(self, caller: str) -> None:
        count = self._in_flight.get(caller, 1) - 1
        if count <= 0:
            self._in_flight.pop(caller, None)
        else:
            self._in_flight[caller] = count

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
                request_deserializer=_lenient(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                edge.wrap_unary(handler.stream_unary),
                request_deserializer=_lenient(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                edge.wrap_stream(cast(Any, handler.unary_stream)),
                request_deserializer=_lenient(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        return grpc.stream_stream_rpc_method_handler(
            edge.wrap_stream(cast(Any, handler.stream_stream)),
            request_deserializer=_lenient(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )

    def identify(self, context: Any) -> Caller:
        """The caller's identity from its client certificate; raises when it is not acceptable."""
        return self._callers.identify(context.auth_context())

    async def admit(
        self,
        method: str,
        policy: RpcPolicy | None,
        metadata: tuple[tuple[str, Any], ...],
        caller: Caller,
        request_id: str,
    ) -> CallContext:
        """Role, capability: raise on the first refusal."""
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
            with _tracer.start_as_current_span("capability.verify", record_exception=False):
                capability = await self._authenticator.authenticate(token, caller)
        return CallContext(request_id=request_id, method=method, caller=caller, capability=capability)


_MAX_UNKNOWN_METHOD = 200


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
        # The caller's free text: bounded in the log line and the message.
        self.method = self.method[:_MAX_UNKNOWN_METHOD]
        try:
            # Who is asking comes first, as for every method: a peer this server does not accept
            # learns nothing about which methods exist.
            error: TokensvcError = NotImplementedRpc(f"{self.method} is not a method of this server")
            try:
                self.caller = self.edge.identify(context).spiffe_id
            except TokensvcError as refused:
                error = refused
            await self._fail(context, error)
        finally:
            self._log(started)
        return b""  # unreachable: _fail aborts

    def wrap_unary(self, behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            async with self._serving(context):
                return await behavior(_decoded(request), context)

        return unary

    def wrap_stream(self, behavior: Callable[..., Any]) -> Callable[..., Any]:
        if not inspect.isasyncgenfunction(behavior):
            # A coroutine that writes its responses with context.write (grpc's Health.Watch).
            return self.wrap_unary(behavior)

        async def stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            async with self._serving(context):
                async for response in behavior(_decoded(request), context):
                    yield response

        return stream

    @contextlib.asynccontextmanager
    async def _serving(self, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[None]:
        """Span, deadline, admission, concurrency slot, call context; errors become statuses."""
        started = time.perf_counter()
        # W3C trace context only: the baggage propagator would log caller-supplied header text.
        parent = _TRACE_CONTEXT.extract(
            {key: value for key, value in self.metadata if isinstance(value, str)}
        )
        with _tracer.start_as_current_span(
            self.method,
            context=parent,
            kind=trace.SpanKind.SERVER,
            attributes={
                "rpc.system": "grpc",
                "rpc.method": self.method,
                "tokensvc.request_id": self.request_id,
            },
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            deadline = use_deadline(context.time_remaining())
            call_token = None
            holding_slot = False
            try:
                # Known before the role and capability checks, so refusals are logged with it.
                caller = self.edge.identify(context)
                self.caller = caller.spiffe_id
                call = await self.edge.admit(self.method, self.policy, self.metadata, caller, self.request_id)
                self.edge.enter(self.caller)
                holding_slot = True
                _annotate(span, call)
                call_token = use_call(call)
                yield
            except asyncio.CancelledError:
                # gRPC cancelled the handler: the client went away or its deadline passed. The
                # client already has its status; record that one, not OK.
                left = context.time_remaining()
                expired = left is not None and left <= _DEADLINE_SLACK_SECONDS
                self.code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
                raise
            except Exception as exc:
                await self._fail(context, exc)
                raise  # unreachable: _fail aborts
            finally:
                if call_token is not None:
                    reset_call(call_token)
                if holding_slot and self.caller is not None:
                    self.edge.leave(self.caller)
                reset_deadline(deadline)
                span.set_attribute("rpc.grpc.status_code", self.code.value[0])
                if self.code is not grpc.StatusCode.OK:
                    span.set_status(trace.Status(trace.StatusCode.ERROR, self.code.name))
                self._log(started)

    async def _fail(self, context: grpc.aio.ServicerContext[Any, Any], exc: Exception) -> None:
        if isinstance(exc, grpc.aio.AbortError):
            raise exc  # already answered (a servicer aborted deliberately)
        info = status_for(exc)
        self.code = info.code
        if info.internal:
            # The exception's type and frames, not its message: a message can quote request
            # content (asyncpg's "invalid input ..." does), which must never reach a log.
            _log.error(
                "internal error",
                extra={
                    "request_id": self.request_id,
                    "method": self.method,
                    "error_type": type(exc).__qualname__,
                    "traceback": "".join(traceback.format_tb(exc.__traceback__)),
                },
            )
        await abort_with(context, info, self.request_id)

    def _log(self, started: float) -> None:
        elapsed = time.perf_counter() - started
        # Unknown method names are the caller's free text: one label for all of them.
        label = self.method if self.policy is not None else "unknown"
        METRICS.rpcs.labels(label, self.code.name).inc()
        METRICS.rpc_seconds.labels(label).observe(elapsed)
        _log.info(
            "rpc",
            extra={
                "request_id": self.request_id,
                "method": self.method,
                "caller": self.caller,
                "status": self.code.name,
                "duration_ms": round(elapsed * 1000, 3),
            },
        )
