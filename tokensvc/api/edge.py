"""The server interceptor every RPC passes through.

For each call, in order: a request id; the caller's identity from its client certificate; the
role check from `policy.POLICIES`; the run capability when the RPC needs one; then the servicer
runs with a `CallContext`. Any exception that escapes becomes a status through `api.status.status_for`
(the one table), sent with `google.rpc.ErrorInfo` (and `BadRequest` for field errors); internal
errors are logged with the request id and answered with a generic message.

The edge runs on every RPC, so it is kept cheap (docs/benchmarks.md, "CPU per call"): each
method's wrapped handler is built once, not per call; the server span and trace-context
extraction exist only when tracing is active; metric children are cached; the log record is made
without a stack walk.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import os
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Protocol, cast

import grpc
from google.protobuf.message import DecodeError
from opentelemetry import context as otel_context
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
from tokensvc.observability.tracing import tracing_active

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
    return os.urandom(16).hex()  # 32 hex digits, as uuid4().hex was, at a quarter of the cost


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
    """The request for the servicer; raises for bytes that did not parse."""
    if request is _UNDECODABLE:
        raise InvalidArgument("request", "is not a well-formed message of this RPC's request type")
    return request


async def _decoded_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """The request stream for the servicer; raises at the first message that did not parse."""
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
        # Method -> (the servicer's handler, the edge's wrapping of it). Only methods with a
        # policy are kept (a fixed set): a caller's free-text method names never grow it.
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler[Any, Any], grpc.RpcMethodHandler[Any, Any]]] = {}

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
        if handler is None:
            # An unknown method still gets a request id and an ErrorInfo reason, like every error.
            metadata = tuple(handler_call_details.invocation_metadata or ())
            return grpc.unary_unary_rpc_method_handler(_Call(self, method, None, metadata).unknown_method)
        # The wrapping is per method, built once: per-call state is made inside it, per call.
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        policy = self._policies.get(method)
        wrapped = _wrap(self, method, policy, handler)
        if policy is not None:
            self._wrapped[method] = (handler, wrapped)
        return wrapped

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
        *,
        traced: bool = False,
    ) -> CallContext:
        """Role, capability: raise on the first refusal. `traced`: verify in a span of its own."""
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
            if traced:
                with _tracer.start_as_current_span("capability.verify", record_exception=False):
                    capability = await self._authenticator.authenticate(token, caller)
            else:
                capability = await self._authenticator.authenticate(token, caller)
        return CallContext(request_id=request_id, method=method, caller=caller, capability=capability)


def _wrap(
    edge: EdgeInterceptor, method: str, policy: RpcPolicy | None, handler: grpc.RpcMethodHandler[Any, Any]
) -> grpc.RpcMethodHandler[Any, Any]:
    """The servicer's handler with every call passing through the edge (`_Call`)."""
    deserializer = _lenient(handler.request_deserializer)
    serializer = handler.response_serializer
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(
            _wrap_unary(edge, method, policy, handler.unary_unary, _decoded),
            request_deserializer=deserializer,
            response_serializer=serializer,
        )
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(
            _wrap_unary(edge, method, policy, handler.stream_unary, _decoded_stream),
            request_deserializer=deserializer,
            response_serializer=serializer,
        )
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            _wrap_stream(edge, method, policy, cast(Any, handler.unary_stream), _decoded),
            request_deserializer=deserializer,
            response_serializer=serializer,
        )
    return grpc.stream_stream_rpc_method_handler(
        _wrap_stream(edge, method, policy, cast(Any, handler.stream_stream), _decoded_stream),
        request_deserializer=deserializer,
        response_serializer=serializer,
    )


_Decode = Callable[[Any], Any]


def _wrap_unary(
    edge: EdgeInterceptor,
    method: str,
    policy: RpcPolicy | None,
    behavior: Callable[..., Awaitable[Any]],
    decode: _Decode,
) -> Callable[..., Awaitable[Any]]:
    async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        call = _Call(edge, method, policy, tuple(context.invocation_metadata() or ()))
        call.begin(context)
        try:
            await call.admit(context)
            return await behavior(decode(request), context)
        except asyncio.CancelledError:
            call.cancelled(context)
            raise
        except Exception as exc:
            await call.fail(context, exc)
            raise  # unreachable: fail aborts
        finally:
            call.end()

    return unary


def _wrap_stream(
    edge: EdgeInterceptor,
    method: str,
    policy: RpcPolicy | None,
    behavior: Callable[..., Any],
    decode: _Decode,
) -> Callable[..., Any]:
    if not inspect.isasyncgenfunction(behavior):
        # A coroutine that writes its responses with context.write (grpc's Health.Watch).
        return _wrap_unary(edge, method, policy, behavior, decode)

    async def stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        call = _Call(edge, method, policy, tuple(context.invocation_metadata() or ()))
        call.begin(context)
        try:
            await call.admit(context)
            async for response in behavior(decode(request), context):
                yield response
        except asyncio.CancelledError:
            call.cancelled(context)
            raise
        except Exception as exc:
            await call.fail(context, exc)
            raise  # unreachable: fail aborts
        finally:
            call.end()

    return stream


_MAX_UNKNOWN_METHOD = 200
_RPC_LOG_LINE = 0  # set below: where the per-RPC log record says it was made


class _Call:
    """One RPC's passage through the edge: begin, admit, the servicer, then fail/cancelled, end.

    The span, trace-context extraction and span attributes exist only while tracing is active
    (an installed tracer provider); without one they cost the no-op API's calls and nothing else.
    """

    __slots__ = (
        "_call_token",
        "_deadline_token",
        "_holding_slot",
        "_span",
        "_span_token",
        "_started",
        "caller",
        "code",
        "edge",
        "metadata",
        "method",
        "policy",
        "reason",
        "request_id",
    )

    def __init__(
        self,
        edge: EdgeInterceptor,
        method: str,
        policy: RpcPolicy | None,
        metadata: tuple[tuple[str, Any], ...],
    ):
        self.edge = edge
        self.method = method
        self.metadata = metadata
        self.policy = policy
        self.request_id = _request_id(metadata)
        self.code = grpc.StatusCode.OK
        # The stable reason sent with a failure (ErrorInfo); a client's cancel or deadline has none.
        self.reason: str | None = None
        self.caller: str | None = None
        self._started = time.perf_counter()
        self._span: trace.Span | None = None
        self._span_token: contextvars.Token[otel_context.Context] | None = None
        self._deadline_token: contextvars.Token[float | None] | None = None
        self._call_token: contextvars.Token[CallContext] | None = None
        self._holding_slot = False

    async def unknown_method(self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
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
            await self.fail(context, error)
        finally:
            self._record()
        return b""  # unreachable: fail aborts

    def begin(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """The server span (when tracing) and the caller's deadline; never raises."""
        if tracing_active():
            # W3C trace context only: the baggage propagator would log caller-supplied header text.
            parent = _TRACE_CONTEXT.extract(
                {key: value for key, value in self.metadata if isinstance(value, str)}
            )
            span = _tracer.start_span(
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
            )
            self._span = span
            self._span_token = otel_context.attach(trace.set_span_in_context(span))
        self._deadline_token = use_deadline(context.time_remaining())

    async def admit(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Identity (known before the role and capability checks, so refusals are logged with
        it), role and capability, the caller's concurrency slot, the call context."""
        caller = self.edge.identify(context)
        self.caller = caller.spiffe_id
        call = await self.edge.admit(
            self.method, self.policy, self.metadata, caller, self.request_id, traced=self._span is not None
        )
        self.edge.enter(self.caller)
        self._holding_slot = True
        if self._span is not None:
            _annotate(self._span, call)
        self._call_token = use_call(call)

    def cancelled(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """gRPC cancelled the handler: the client went away or its deadline passed. The client
        already has its status; record that one, not OK."""
        left = context.time_remaining()
        expired = left is not None and left <= _DEADLINE_SLACK_SECONDS
        self.code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED

    async def fail(self, context: grpc.aio.ServicerContext[Any, Any], exc: Exception) -> None:
        if isinstance(exc, grpc.aio.AbortError):
            raise exc  # already answered (a servicer aborted deliberately)
        info = status_for(exc)
        self.code = info.code
        self.reason = info.reason.value
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

    def end(self) -> None:
        """Undo what begin and admit set, in reverse; then the metrics and the log line."""
        if self._call_token is not None:
            reset_call(self._call_token)
        if self._holding_slot and self.caller is not None:
            self.edge.leave(self.caller)
        if self._deadline_token is not None:
            reset_deadline(self._deadline_token)
        span = self._span
        if span is not None:
            span.set_attribute("rpc.grpc.status_code", self.code.value[0])
            if self.code is not grpc.StatusCode.OK:
                span.set_status(trace.Status(trace.StatusCode.ERROR, self.code.name))
        self._record()
        if span is not None:
            if self._span_token is not None:
                otel_context.detach(self._span_token)
            span.end()

    def _record(self) -> None:
        """The RPC's metrics and its one log line (request id, method, caller, status, duration)."""
        elapsed = time.perf_counter() - self._started
        # Unknown method names are the caller's free text: one label for all of them.
        label = self.method if self.policy is not None else "unknown"
        status = self.code.name
        METRICS.rpcs.labels(label, status).inc()
        if self.code is not grpc.StatusCode.OK:
            METRICS.rpc_errors.labels(label, status, self.reason or status).inc()
        METRICS.rpc_seconds.labels(label).observe(elapsed)
        if _log.isEnabledFor(logging.INFO):
            # Logger.info would also walk the stack for the caller's file and line (findCaller)
            # and check each extra key: the record is made directly, with fixed keys.
            record = _log.makeRecord(
                _log.name, logging.INFO, __file__, _RPC_LOG_LINE, "rpc", (), None, "_record"
            )
            record.__dict__.update(
                request_id=self.request_id,
                method=self.method,
                caller=self.caller,
                status=status,
                duration_ms=round(elapsed * 1000, 3),
            )
            _log.handle(record)


_RPC_LOG_LINE = _Call._record.__code__.co_firstlineno
