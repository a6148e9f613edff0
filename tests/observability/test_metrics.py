"""Prometheus metrics on their own HTTP port: a real service is called, then scraped."""

from __future__ import annotations

import asyncio
import contextlib
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.api.memory_support import Launchers
from tests.conftest import ServiceFactory
from tests.support import failure_of, free_port, role_channel
from tokensvc.app import Service
from tokensvc.auth.devpki import DevPaths
from tokensvc.observability import METRICS
from tokensvc.storage.postgres.monitoring import PostgresStatistics
from tokensvc.storage.postgres.reembedding import PostgresEmbeddingMigrationStore
from tokensvc.storage.postgres.rotations import PostgresRotationJournal
from tokensvc.supervision import refresh_gauges_forever
from tokensvc.v1 import memory_pb2

REMEMBER = "/tokensvc.v1.MemoryService/Remember"
SEARCH = "/tokensvc.v1.MemoryService/SearchMemories"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape_text(port: int) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        return str(response.read().decode("utf-8"))


async def scrape(port: int) -> tuple[str, Samples]:
    text = await asyncio.to_thread(scrape_text, port)
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return text, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture
async def metered(start_service: ServiceFactory) -> tuple[Service, int]:
    port = free_port()
    service = await start_service(metrics_address=f"127.0.0.1:{port}")
    return service, port


@pytest.fixture
async def launchers(metered: tuple[Service, int], dev: DevPaths, tmp_path: Path) -> AsyncIterator[Launchers]:
    pool = Launchers(metered[0], dev, tmp_path / "launchers")
    yield pool
    await pool.aclose()


async def test_scrape_counts_rpcs_verifications_pool_embedder_and_memories(
    metered: tuple[Service, int], launchers: Launchers
) -> None:
    service, port = metered
    _, before = await scrape(port)

    caller = launchers.caller()
    await caller.remember("a fact for the metrics scrape", "another fact for the metrics scrape")
    await caller.search("metrics scrape")  # the same token again: a cache hit
    refused = await caller.fail(
        "SearchMemories", memory_pb2.SearchMemoriesRequest(query_text="x", top_k=1000)
    )
    assert refused.code is grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await caller.memory.Remember(memory_pb2.RememberRequest(), timeout=10)  # no capability
    assert failure_of(missing.value).code is grpc.StatusCode.UNAUTHENTICATED

    # The database gauges refresh every minute in the background; run one refresh now.
    assert service.database is not None
    pool = service.database.pool
    refresher = asyncio.create_task(
        refresh_gauges_forever(
            PostgresStatistics(pool),
            [PostgresRotationJournal(pool)],
            PostgresEmbeddingMigrationStore(pool),
            3600.0,
        )
    )
    try:
        for _ in range(200):
            if METRICS.live.database.memories_per_space.get(("default", caller.agent)) == 2:
                break
            await asyncio.sleep(0.05)
    finally:
        refresher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await refresher

    text, after = await scrape(port)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("tokensvc_rpcs_total", method=REMEMBER, code="OK") >= 1
    assert grew("tokensvc_rpcs_total", method=SEARCH, code="OK") >= 1
    assert grew("tokensvc_rpcs_total", method=SEARCH, code="INVALID_ARGUMENT") >= 1
    assert grew("tokensvc_rpcs_total", method=REMEMBER, code="UNAUTHENTICATED") >= 1
    # Failures again, by their stable reason; successes are not errors.
    assert (
        grew("tokensvc_rpc_errors_total", method=SEARCH, code="INVALID_ARGUMENT", reason="INVALID_ARGUMENT")
        >= 1
    )
    assert (
        grew(
            "tokensvc_rpc_errors_total", method=REMEMBER, code="UNAUTHENTICATED", reason="CAPABILITY_MISSING"
        )
        >= 1
    )
    assert not [key for key in after if key[0] == "tokensvc_rpc_errors_total" and ("code", "OK") in key[1]]
    # Latency histograms: every bucket, the +Inf bucket equal to the count.
    buckets = [
        key
        for key in after
        if key[0] == "tokensvc_rpc_duration_seconds_bucket" and ("method", SEARCH) in key[1]
    ]
    assert len(buckets) >= 10
    inf = value(after, "tokensvc_rpc_duration_seconds_bucket", method=SEARCH, le="+Inf")
    assert inf == value(after, "tokensvc_rpc_duration_seconds_count", method=SEARCH) >= 2
    assert grew("tokensvc_rpc_duration_seconds_count", method=REMEMBER) >= 2

    assert grew("tokensvc_capability_verifications_total", outcome="accepted") >= 3
    assert grew("tokensvc_capability_cache_total", result="miss") >= 1
    assert grew("tokensvc_capability_cache_total", result="hit") >= 2

    assert value(after, "tokensvc_db_pool_connections") >= 1
    assert value(after, "tokensvc_db_pool_max_connections") == service.settings.pool_max_size
    assert value(after, "tokensvc_serving") == 1
    staleness = value(after, "tokensvc_revocation_max_staleness_seconds")
    assert 0 <= value(after, "tokensvc_revocation_sync_age_seconds") < staleness
    # One Remember of two texts: one embedder call of 2 (searches embed one query each).
    assert grew("tokensvc_embed_batch_size_sum", embedder="hash") >= 2 + 1
    assert grew("tokensvc_embed_batch_size_bucket", embedder="hash", le="1.0") >= 1
    assert grew("tokensvc_embed_batch_size_count", embedder="hash") >= 2
    # Initialised at zero, so rate() is 0 rather than absent before the first failure.
    assert ("tokensvc_embed_errors_total", frozenset({("embedder", "hash")})) in after
    assert value(after, "tokensvc_credential_rotations_open") == 0
    assert ("tokensvc_db_pool_in_use", frozenset()) in after
    # The Remember's batch and the search's query, timed apart.
    assert grew("tokensvc_embed_duration_seconds_count", embedder="hash", call="documents") >= 1
    assert grew("tokensvc_embed_duration_seconds_count", embedder="hash", call="query") >= 1
    assert (
        value(after, "tokensvc_embed_duration_seconds_bucket", embedder="hash", call="query", le="+Inf") >= 1
    )
    assert "# TYPE tokensvc_embed_errors_total counter" in text
    assert value(after, "tokensvc_memories", namespace="default", agent=caller.agent) == 2
    assert "# TYPE tokensvc_credential_rotations_total counter" in text


async def test_unknown_methods_share_one_label(metered: tuple[Service, int], dev: DevPaths) -> None:
    """A caller's free-text method names never become new time series."""
    service, port = metered
    channel = role_channel(service.port, dev, "admin")
    try:
        for name in ("/x.Y/Z1", "/x.Y/Z2"):
            call = channel.unary_unary(name, request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call(b"", timeout=10)
            assert caught.value.code() is grpc.StatusCode.UNIMPLEMENTED
    finally:
        await channel.close(grace=None)
    text, samples = await scrape(port)
    assert value(samples, "tokensvc_rpcs_total", method="unknown", code="UNIMPLEMENTED") >= 2
    assert "/x.Y/Z1" not in text


async def test_label_children_are_reused_and_scraped(metered: tuple[Service, int]) -> None:
    """labels() answers from a cache after the first call; the child is prometheus_client's own."""
    _, port = metered
    child = METRICS.rpcs.labels("/test.Cached/Labels", "OK")
    assert METRICS.rpcs.labels("/test.Cached/Labels", "OK") is child
    assert METRICS.rpcs.labels(method="/test.Cached/Labels", code="OK") is child
    child.inc()
    METRICS.rpcs.labels("/test.Cached/Labels", "OK").inc(2)
    _, samples = await scrape(port)
    assert value(samples, "tokensvc_rpcs_total", method="/test.Cached/Labels", code="OK") == 3
    METRICS.rpcs.remove("/test.Cached/Labels", "OK")
    fresh = METRICS.rpcs.labels("/test.Cached/Labels", "OK")
    assert fresh is not child  # a removed series starts again from zero
    _, samples = await scrape(port)
    assert value(samples, "tokensvc_rpcs_total", method="/test.Cached/Labels", code="OK") == 0
