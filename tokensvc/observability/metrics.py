"""Prometheus metrics, served on their own HTTP port (never on the mTLS gRPC port).

One set of metrics per process (Prometheus registries reject duplicates); live values such as
pool sizes are read at scrape time from the components registered with `METRICS.watch_pool`.
The labelled metrics hand out their per-label children from a plain dict after the first
`labels(...)` call for a label tuple: prometheus_client's own lookup (validation, str conversion,
a lock) ran several times per RPC.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

from prometheus_client import REGISTRY, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

__all__ = ["METRICS", "Metrics", "observe_embedding", "start_metrics_server"]

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
    pass


class _Histogram(_CachedLabels, Histogram):
    pass


_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class _LiveGauges(Collector):
    """Gauges computed when scraped: pool sizes and memories per space."""

    def __init__(self) -> None:
        self._pools: list[Callable[[], tuple[int, int]]] = []
        self.memories_per_space: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def watch_pool(self, sizes: Callable[[], tuple[int, int]]) -> Callable[[], None]:
        with self._lock:
            self._pools.append(sizes)
        return lambda: self._unwatch(sizes)

    def _unwatch(self, sizes: Callable[[], tuple[int, int]]) -> None:
        with self._lock:
            if sizes in self._pools:
                self._pools.remove(sizes)

    def collect(self) -> Iterator[Any]:
        size = GaugeMetricFamily("tokensvc_db_pool_connections", "Open database connections.")
        in_use = GaugeMetricFamily("tokensvc_db_pool_in_use", "Database connections serving a request now.")
        with self._lock:
            pools = list(self._pools)
        total = busy = 0
        for sizes in pools:
            open_, used = sizes()
            total += open_
            busy += used
        size.add_metric([], total)
        in_use.add_metric([], busy)
        yield size
        yield in_use
        spaces = GaugeMetricFamily(
            "tokensvc_memories", "Live memories per memory space.", labels=["namespace", "agent"]
        )
        for (namespace, agent), count in sorted(self.memories_per_space.items()):
            spaces.add_metric([namespace, agent], count)
        yield spaces


class Metrics:
    def __init__(self) -> None:
        self.rpcs = _Counter("tokensvc_rpcs", "RPCs by method and status code.", ["method", "code"])
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
            "Embedding latency by embedder.",
            ["embedder"],
            buckets=_LATENCY_BUCKETS,
        )
        self.embed_errors = _Counter("tokensvc_embed_errors", "Embedding failures by embedder.", ["embedder"])
        self.extractions = _Counter(
            "tokensvc_document_extractions",
            "Uploaded documents extracted and chunked, by outcome "
            "(ok, refused, deadline, cancelled, time_limit, worker_died).",
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
        self.live = _LiveGauges()
        REGISTRY.register(self.live)


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


async def observe_embedding(embedder: str, call: Awaitable[_T]) -> _T:
    """Time one embedder call and count its failures."""
    started = time.perf_counter()
    try:
        return await call
    except Exception:
        METRICS.embed_errors.labels(embedder).inc()
        raise
    finally:
        METRICS.embed_seconds.labels(embedder).observe(time.perf_counter() - started)
