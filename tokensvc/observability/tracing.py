"""OpenTelemetry tracing: one tracer provider per process, OTLP export when configured.

Span attributes carry tenant identifiers (namespace, agent, bucket id) and counts — never content,
tokens or user ids. Database spans come from the asyncpg instrumentation, which records the SQL
text (our SQL has no literals: every value is a bind parameter) and not the parameters.
"""

from __future__ import annotations

import logging

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

__all__ = ["configure_tracing", "tracer", "tracing_active"]

_log = logging.getLogger(__name__)
_state = {"configured": False, "active": False}


def tracer(name: str = "tokensvc") -> trace.Tracer:
    return trace.get_tracer(name)


def tracing_active() -> bool:
    """Whether a tracer provider is installed, so spans would be recorded and exported.

    Until one is, every tracer is OpenTelemetry's proxy to a no-op and a span is pure cost: the
    edge then skips its server span, trace-context extraction and span attributes. A provider
    can be installed once and never removed, so the answer is cached once it is True.
    """
    if not _state["active"]:
        _state["active"] = not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    return _state["active"]


def configure_tracing(otlp_endpoint: str | None, *, extra_processor: SpanProcessor | None = None) -> None:
    """Install the SDK provider once per process; later calls only add processors.

    With nothing to export to, nothing is installed: spans stay non-recording, which costs
    almost nothing per RPC (recording ~8 spans per search measurably slows the hot path).
    """
    if not otlp_endpoint and extra_processor is None:
        return
    provider = trace.get_tracer_provider()
    if not _state["configured"]:
        if not isinstance(provider, TracerProvider):
            provider = TracerProvider(resource=Resource.create({"service.name": "tokensvc"}))
            trace.set_tracer_provider(provider)
        from opentelemetry.instrumentation.asyncpg import AsyncPGInstrumentor

        AsyncPGInstrumentor().instrument(tracer_provider=provider)  # type: ignore[no-untyped-call]
        _state["configured"] = True
    assert isinstance(provider, TracerProvider)
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint)))
        _log.info("exporting traces over OTLP", extra={"endpoint": otlp_endpoint})
    if extra_processor is not None:
        provider.add_span_processor(extra_processor)
