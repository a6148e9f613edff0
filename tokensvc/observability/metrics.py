"""Prometheus metrics, served on their own HTTP port (never on the mTLS gRPC port).

One set of metrics per process (Prometheus registries reject duplicates); live values (pool use,
health, the revocation list's age) are read at scrape time from the services registered with
`METRICS.live.watch`, and values read from the database (memories per space, open credential
rotations, active re-embedding migrations) are refreshed by a background duty into
`METRICS.live.database`. deploy/components/monitoring's rules and dashboard are written against
these names; a test checks every name they use is exported.
The labelled metrics hand out their per-label children from a plain dict after the first
`labels(...)` call for a label tuple: prometheus_client's own lookup (validation, str conversion,
a lock) ran several times per RPC.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

__all__ = [
    "METRICS",
    "ActiveMigration",
    "DatabaseReadings",
    "Metrics",
    "Vitals",
    "observe_embedding",
    "start_metrics_server",
]

_log = logging.getLogger(__name__)
_T = TypeVar("_T")
_M = TypeVar("_M", bound="_CachedLabels")


class _CachedLabels(MetricWrapperBase):
    """`labels(*values)` answered from a dict once a label tuple has been seen.

    The children are prometheus_client's own (the cache only skips its per-call validation, str
    conversion and lock); the label sets are bounded by what the callers pass (methods, codes,
    outcomes, embedder names), as prometheus_client's own child table is.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._children: dict[tuple[object, ...], Any] = {}

    def labels(self: _M, *values: object, **by_name: object) -> _M:
        if by_name:
            return super().labels(*values, **by_name)
        child: _M | None = self._children.get(values)
        if child is None:
            child = self._children[values] = super().labels(*values)
        return child

    def remove(self, *values: Any) -> None:
        super().remove(*values)
        self._children = {}

    def remove_by_labels(self, labels: dict[str, str]) -> None:
        super().remove_by_labels(labels)
        self._children = {}

    def clear(self) -> None:
        super().clear()
        self._children = {}


class _Counter(_CachedLabels, Counter):
    """A Counter with cached label children."""


class _Gauge(_CachedLabels, Gauge):
    """A Gauge with cached label children."""


class _Histogram(_CachedLabels, Histogram):
    pass


_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
# Waits in the embedder's queue: from a query behind one running batch to bulk work behind hours.
_WAIT_BUCKETS = (0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass(frozen=True)
class Vitals:
    """One running service's live state, read at every scrape."""

    pool_open: int
    pool_in_use: int
    pool_max: int
    serving: bool
    revocation_age_seconds: float
    revocation_max_staleness_seconds: float


@dataclass(frozen=True)
class ActiveMigration:
    """A re-embedding migration not finished yet: what the stall alert watches."""

    id: str
    kind: str  # "memory_space" or "knowledge_base"
    state: str
    rows_done: int
    rows_total: int


@dataclass(frozen=True)
class IngestionReadings:
    """The background ingestion queue across every namespace: what the stuck-queue alert watches."""

    pending: int
    processing: int
    failed: int
    oldest_seconds: float


@dataclass(frozen=True)
class DatabaseReadings:
    """What the background refresh last read from the database (counts and times only)."""

    memories_per_space: dict[tuple[str, str], int] = field(default_factory=dict)
    open_rotations: int = 0
    oldest_open_rotation_started: float = 0.0  # Unix time; 0 when none is open
    migrations: tuple[ActiveMigration, ...] = ()
    ingestion: IngestionReadings | None = None  # None: not read yet


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation)
    family.add_metric([], value)
    return family


class _LiveGauges(Collector):
    """Gauges computed when scraped, from the watched services and the last database readings."""

    def __init__(self) -> None:
        self._services: list[Callable[[], Vitals]] = []
        self.database = DatabaseReadings()
        self._lock = threading.Lock()

    def watch(self, vitals: Callable[[], Vitals]) -> Callable[[], None]:
        """Read `vitals()` at every scrape until the returned function is called."""
        with self._lock:
            self._services.append(vitals)
        return lambda: self._unwatch(vitals)

    def _unwatch(self, vitals: Callable[[], Vitals]) -> None:
        with self._lock:
            if vitals in self._services:
                self._services.remove(vitals)

    def collect(self) -> Iterator[Any]:
        with self._lock:
            watched = list(self._services)
        services = []
        for vitals in watched:
            # Read off the event loop's objects from the scrape thread: a read that races a change
            # skips this service for one scrape instead of failing the whole /metrics response.
            try:
                services.append(vitals())
            except Exception as exc:
                _log.debug("service vitals unreadable this scrape", extra={"error": type(exc).__name__})
        yield from self._service_gauges(services)
        yield from self._database_gauges(self.database)

    @staticmethod
    def _service_gauges(services: Iterable[Vitals]) -> Iterator[GaugeMetricFamily]:
        # One service per process in production; tests run several in one (pools add up, health
        # and the revocation list report the worst of them).
        services = list(services)
        yield _gauge(
            "tokensvc_db_pool_connections", "Open database connections.", sum(v.pool_open for v in services)
        )
        yield _gauge(
            "tokensvc_db_pool_in_use",
            "Database connections serving a request now.",
            sum(v.pool_in_use for v in services),
        )
        yield _gauge(
            "tokensvc_db_pool_max_connections",
            "The most database connections the pool opens (setting pool_max_size).",
            sum(v.pool_max for v in services),
        )
        if not services:
            return
        yield _gauge(
            "tokensvc_serving",
            "1 while this replica's gRPC health is SERVING, 0 while NOT_SERVING (database unreachable).",
            min(1 if v.serving else 0 for v in services),
        )
        yield _gauge(
            "tokensvc_revocation_sync_age_seconds",
            "Seconds since the revocation list last synced with the database.",
            max(v.revocation_age_seconds for v in services),
        )
        yield _gauge(
            "tokensvc_revocation_max_staleness_seconds",
            "Sync age past which capabilities are refused (fail closed).",
            min(v.revocation_max_staleness_seconds for v in services),
        )

    @staticmethod
    def _database_gauges(readings: DatabaseReadings) -> Iterator[GaugeMetricFamily]:
        spaces = GaugeMetricFamily(
            "tokensvc_memories", "Live memories per memory space.", labels=["namespace", "agent"]
        )
        for (namespace, agent), count in sorted(readings.memories_per_space.items()):
            spaces.add_metric([namespace, agent], count)
        yield spaces
        yield _gauge(
            "tokensvc_credential_rotations_open",
            "Credential rotations journaled as in progress.",
            readings.open_rotations,
        )
        yield _gauge(
            "tokensvc_credential_rotation_oldest_open_timestamp_seconds",
            "When the oldest rotation still in progress started (Unix time; 0 when none is).",
            readings.oldest_open_rotation_started,
        )
        labels = ["migration", "kind", "state"]
        done = GaugeMetricFamily(
            "tokensvc_embedding_migration_rows_done",
            "Rows an unfinished migration has re-embedded.",
            labels=labels,
        )
        total = GaugeMetricFamily(
            "tokensvc_embedding_migration_rows_expected",
            "Rows an unfinished migration has to re-embed in all.",
            labels=labels,
        )
        for migration in readings.migrations:
            values = [migration.id, migration.kind, migration.state]
            done.add_metric(values, migration.rows_done)
            total.add_metric(values, migration.rows_total)
        yield done
        yield total
        # Both families always (without samples until the queue was read), as the rules expect.
        queue = GaugeMetricFamily(
            "tokensvc_ingestion_queue",
            "Uploaded document versions not searchable yet, by state: pending (waiting for a "
            "runner), processing (a runner holds it), failed (given up, with a reason).",
            labels=["state"],
        )
        oldest = GaugeMetricFamily(
            "tokensvc_ingestion_oldest_seconds",
            "How long the oldest unfinished upload has waited to become searchable (0: none).",
        )
        if readings.ingestion is not None:
            queue.add_metric(["pending"], readings.ingestion.pending)
            queue.add_metric(["processing"], readings.ingestion.processing)
            queue.add_metric(["failed"], readings.ingestion.failed)
            oldest.add_metric([], readings.ingestion.oldest_seconds)
        yield queue
        yield oldest


class Metrics:
    def __init__(self) -> None:
        self.rpcs = _Counter("tokensvc_rpcs", "RPCs by method and status code.", ["method", "code"])
        self.rpc_errors = _Counter(
            "tokensvc_rpc_errors",
            "Failed RPCs by method, status code and stable reason (the ErrorInfo reason).",
            ["method", "code", "reason"],
        )
        self.rpc_seconds = _Histogram(
            "tokensvc_rpc_duration_seconds", "RPC latency by method.", ["method"], buckets=_LATENCY_BUCKETS
        )
        self.verifications = _Counter(
            "tokensvc_capability_verifications", "Capability checks by outcome.", ["outcome"]
        )
        self.verification_cache = _Counter(
            "tokensvc_capability_cache", "Verified-capability cache lookups.", ["result"]
        )
        self.embed_seconds = _Histogram(
            "tokensvc_embed_duration_seconds",
            "Embedder call latency by embedder and call (query: one search's text; documents: a batch).",
            ["embedder", "call"],
            buckets=_LATENCY_BUCKETS,
        )
        self.embed_errors = _Counter("tokensvc_embed_errors", "Embedding failures by embedder.", ["embedder"])
        self.embed_batch = _Histogram(
            "tokensvc_embed_batch_size",
            "Texts per embedder call, by embedder.",
            ["embedder"],
            buckets=_BATCH_BUCKETS,
        )
        self.embed_queued = _Gauge(
            "tokensvc_embed_queue_texts",
            "Texts waiting for an embedder, by embedder and class (query, interactive, bulk).",
            ["embedder", "work"],
        )
        self.embed_wait_seconds = _Histogram(
            "tokensvc_embed_wait_seconds",
            "How long a call waited for its first slice to reach the embedder, by embedder and class.",
            ["embedder", "work"],
            buckets=_WAIT_BUCKETS,
        )
        self.embed_refused = _Counter(
            "tokensvc_embed_refused",
            "Embedder calls refused because the tenant's queue in that class was full (CONCURRENCY_LIMIT).",
            ["embedder", "work"],
        )
        self.extractions = _Counter(
            "tokensvc_document_extractions",
            "Uploaded documents extracted and chunked, by outcome "
            "(ok, refused, deadline, cancelled, time_limit, worker_died).",
            ["outcome"],
        )
        self.ingested_chunks = _Counter(
            "tokensvc_ingested_chunks",
            "Chunks of uploaded documents embedded by background ingestion, by embedder.",
            ["embedder"],
        )
        self.ingestions = _Counter(
            "tokensvc_ingestions",
            "Document versions that ended background ingestion: ready (searchable), refused (the "
            "content cannot be extracted) or failed (the embedder kept failing).",
            ["outcome"],
        )
        self.migration_rows = _Counter(
            "tokensvc_embedding_migration_rows",
            "Memories re-embedded by migrations, by target embedder.",
            ["embedder"],
        )
        self.migration_events = _Counter(
            "tokensvc_embedding_migration_events",
            "Re-embedding migration events (started, cut_over, succeeded, cancel_requested, "
            "cancelled, embedder_failure, paused, resumed).",
            ["event"],
        )
        self.rotations = _Counter(
            "tokensvc_credential_rotations", "Credential rotations by mode and outcome.", ["mode", "outcome"]
        )
        self.sweeps = _Counter("tokensvc_memory_sweeps", "Expired-memory sweeps by outcome.", ["outcome"])
        self.swept = _Counter("tokensvc_memories_swept", "Expired memories deleted by the sweeper.")
        self.sweep_last_success = Gauge(
            "tokensvc_memory_sweep_last_success_timestamp_seconds",
            "When the expired-memory sweeper last finished a sweep (Unix time; the start time before).",
        )
        self.sweep_interval = Gauge(
            "tokensvc_memory_sweep_interval_seconds",
            "Seconds between sweeps (memory_sweep_interval_seconds).",
        )
        self.live = _LiveGauges()
        REGISTRY.register(self.live)

    def initialise(self, embedders: Iterable[str]) -> None:
        """Create the series that alerts divide by or compare, at zero, before anything happens:
        an absent series makes `rate()` empty instead of 0."""
        for name in embedders:
            self.embed_errors.labels(name)
            for call in ("query", "documents"):
                self.embed_seconds.labels(name, call)
            self.embed_batch.labels(name)
            self.migration_rows.labels(name)
            self.ingested_chunks.labels(name)
            for work in ("query", "interactive", "bulk"):
                self.embed_queued.labels(name, work)
                self.embed_refused.labels(name, work)
                self.embed_wait_seconds.labels(name, work)
        for outcome in ("ok", "refused", "deadline", "cancelled", "time_limit", "worker_died"):
            self.extractions.labels(outcome=outcome)
        for mode in ("reload", "rotate"):
            for outcome in ("succeeded", "failed"):
                self.rotations.labels(mode, outcome)
        for outcome in ("succeeded", "failed"):
            self.sweeps.labels(outcome)
        for outcome in ("ready", "refused", "failed"):
            self.ingestions.labels(outcome)
        for event in (
            "started",
            "cut_over",
            "succeeded",
            "cancel_requested",
            "cancelled",
            "embedder_failure",
            "paused",
            "resumed",
        ):
            self.migration_events.labels(event)


METRICS = Metrics()


def start_metrics_server(address: str) -> Callable[[], None]:
    """Serve /metrics on `host:port`; returns a function that stops it."""
    host, _, port = address.rpartition(":")
    server, thread = start_http_server(int(port), addr=host.strip("[]"))

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(5)

    return stop


async def observe_embedding(embedder: str, call: Awaitable[_T], *, texts: int | None = None) -> _T:
    """Time one embedder call and count its failures: a query's (`texts` None) or a batch of
    `texts` documents. Queries are timed apart, as a search waits for one; a batch of 64 chunks
    on a CPU model takes seconds and would hide a slow query in a shared p99."""
    METRICS.embed_batch.labels(embedder).observe(1 if texts is None else texts)
    started = time.perf_counter()
    try:
        return await call
    except Exception:
        METRICS.embed_errors.labels(embedder).inc()
        raise
    finally:
        kind = "query" if texts is None else "documents"
        METRICS.embed_seconds.labels(embedder, kind).observe(time.perf_counter() - started)
