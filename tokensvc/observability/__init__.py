"""Tracing (OpenTelemetry), metrics (Prometheus) and request deadlines."""

from tokensvc.observability.deadlines import current_deadline, use_deadline
from tokensvc.observability.metrics import (
    METRICS,
    ActiveMigration,
    DatabaseReadings,
    Metrics,
    Vitals,
    start_metrics_server,
)
from tokensvc.observability.tracing import configure_tracing, tracer, tracing_active

__all__ = [
    "METRICS",
    "ActiveMigration",
    "DatabaseReadings",
    "Metrics",
    "Vitals",
    "configure_tracing",
    "current_deadline",
    "start_metrics_server",
    "tracer",
    "tracing_active",
    "use_deadline",
]
