"""A real Prometheus (Debian's `prometheus` package) scrapes a real tokensvc on loopback, with the
monitoring component's rules loaded: every metric and label the rules and the dashboard name is in
what it scraped, every recording rule and dashboard query returns series, and every rule
evaluates without error.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from tests.api.memory_support import Launchers
from tests.conftest import ServiceFactory
from tests.monitoring.rules import (
    dashboard_expressions,
    grouping_labels,
    prometheus_binary,
    recording_rules,
    rule_expressions,
    selectors,
    write_rules,
)
from tests.support import failure_of, free_port
from tokensvc.app import Service
from tokensvc.auth.devpki import DevPaths
from tokensvc.observability import METRICS
from tokensvc.storage.postgres.ingestion import PostgresIngestionStore
from tokensvc.storage.postgres.monitoring import PostgresStatistics
from tokensvc.storage.postgres.reembedding import PostgresEmbeddingMigrationStore
from tokensvc.storage.postgres.rotations import PostgresRotationJournal
from tokensvc.storage.records import EmbedderSpec
from tokensvc.storage.reembedding_records import MemorySpaceMigration, MigrationState
from tokensvc.supervision import read_database_gauges
from tokensvc.v1 import memory_pb2

pytestmark = pytest.mark.slow

# Labels every scraped series gets from its target: Prometheus' own, and those the
# prometheus-operator's ServiceMonitor adds (set as static target labels here).
OPERATOR_LABELS = {"namespace": "tokensvc", "service": "tokensvc", "endpoint": "metrics", "pod": "tokensvc-0"}
TARGET_LABELS = {"instance", "job", *OPERATOR_LABELS}


def _opener() -> urllib.request.OpenerDirector:
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


class PrometheusApi:
    def __init__(self, port: int):
        self.base = f"http://127.0.0.1:{port}"

    def get(self, path: str, **params: str) -> Any:
        url = f"{self.base}{path}?{urllib.parse.urlencode(params)}"
        with _opener().open(url, timeout=10) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return body["data"]

    def ready(self) -> bool:
        try:
            with _opener().open(f"{self.base}/-/ready", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def query(self, expression: str) -> list[dict[str, Any]]:
        return list(self.get("/api/v1/query", query=expression)["result"])

    def series(self, metric: str) -> list[dict[str, str]]:
        return list(self.get("/api/v1/series", **{"match[]": metric, "start": str(time.time() - 600)}))


def start_prometheus(directory: Path, metrics_port: int) -> tuple[subprocess.Popen[bytes], PrometheusApi]:
    """Prometheus with tokensvc's rules, scraping `metrics_port` every second."""
    directory.mkdir()
    write_rules(directory)
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["rules.yaml"],
        # The job name the ServiceMonitor gives it (the Service's name).
        "scrape_configs": [
            {
                "job_name": "tokensvc",
                "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"], "labels": OPERATOR_LABELS}],
            }
        ],
    }
    (directory / "prometheus.yml").write_text(yaml.safe_dump(config), encoding="utf-8")
    port = free_port()
    process = subprocess.Popen(
        [
            prometheus_binary("prometheus"),
            f"--config.file={directory / 'prometheus.yml'}",
            f"--storage.tsdb.path={directory / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=(directory / "prometheus.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    return process, PrometheusApi(port)


@pytest.fixture
async def metered(
    start_service: ServiceFactory, dev: DevPaths, tmp_path: Path
) -> AsyncIterator[tuple[Service, int, Launchers]]:
    port = free_port()
    service = await start_service(metrics_address=f"127.0.0.1:{port}")
    launchers = Launchers(service, dev, tmp_path / "launchers")
    yield service, port, launchers
    await launchers.aclose()


async def drive_traffic(service: Service, launchers: Launchers) -> str:
    """Successes and caller errors over memory RPCs, and an unfinished migration; returns its id."""
    caller = launchers.caller()
    await caller.remember("the scrape test's first fact", "the scrape test's second fact")
    for _ in range(3):
        await caller.search("scrape test")
    refused = await caller.fail(
        "SearchMemories", memory_pb2.SearchMemoriesRequest(query_text="x", top_k=1000)
    )
    assert refused.code is grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await caller.memory.Remember(memory_pb2.RememberRequest(), timeout=10)
    assert failure_of(missing.value).code is grpc.StatusCode.UNAUTHENTICATED

    # A migration to an embedder no replica has: it stays backfilling, so its gauges exist.
    assert service.database is not None
    assert service.embedders is not None
    pool = service.database.pool
    migrations = PostgresEmbeddingMigrationStore(pool)
    created = await migrations.create(
        MemorySpaceMigration(
            id=str(uuid.uuid4()),
            namespace="default",
            agent=caller.agent,
            from_generation=0,
            source=service.embedders.get(service.settings.memory_embedder).spec,
            target=EmbedderSpec("on-no-replica", "none", 8, True),
            state=MigrationState.BACKFILLING,
            created_by="spiffe://test/monitoring",
        )
    )
    assert created is not None
    METRICS.live.database = await read_database_gauges(
        PostgresStatistics(pool), [PostgresRotationJournal(pool)], migrations, PostgresIngestionStore(pool)
    )
    return created.id


def wait_for(condition: Any, what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def made_by_label_replace(expression: str) -> set[str]:
    return set(re.findall(r'label_replace\(.*?,\s*"(\w+)"', expression, flags=re.DOTALL))


async def test_prometheus_scrapes_every_metric_and_label_the_rules_and_dashboard_use(
    metered: tuple[Service, int, Launchers], tmp_path: Path
) -> None:
    service, metrics_port, launchers = metered
    migration = await drive_traffic(service, launchers)
    process, api = start_prometheus(tmp_path / "prometheus", metrics_port)
    try:
        await asyncio.to_thread(wait_for, api.ready, "Prometheus to be ready")
        targets = await asyncio.to_thread(
            wait_for,
            lambda: [t for t in api.get("/api/v1/targets")["activeTargets"] if t["health"] == "up"],
            "the tokensvc target to be up",
        )
        assert targets[0]["labels"]["job"] == "tokensvc"
        # More traffic between scrapes, so rates over the windows have something to measure.
        for _ in range(6):
            await drive_more(launchers)
            await asyncio.sleep(1)
        await asyncio.to_thread(check_scraped_names, api)
        await asyncio.to_thread(check_queries_return_series, api)
        groups = api.get("/api/v1/rules")["groups"]
        rules = [rule for group in groups for rule in group["rules"]]
        assert len(rules) == len(rule_expressions())
        assert [rule["name"] for rule in rules if rule["health"] != "ok"] == []
        done = api.query(f'tokensvc_embedding_migration_rows_done{{migration="{migration}"}}')
        assert [series["metric"]["state"] for series in done] == ["backfilling"]
    finally:
        process.terminate()
        process.wait(timeout=30)
        assert service.database is not None
        await PostgresEmbeddingMigrationStore(
            service.database.pool, runner_pool=service.database.runner_pool
        ).transition(migration, expect=[MigrationState.BACKFILLING], state=MigrationState.CANCELLED)


async def drive_more(launchers: Launchers) -> None:
    caller = launchers.caller()
    await caller.remember("another fact between scrapes")
    await caller.search("fact between scrapes")
    await caller.fail("SearchMemories", memory_pb2.SearchMemoriesRequest(query_text="x", top_k=1000))


def check_scraped_names(api: PrometheusApi) -> None:
    recorded = {rule["record"] for rule in recording_rules()}
    for expression in [*rule_expressions(), *dashboard_expressions()]:
        seen_labels: set[str] = set()
        for selector in selectors(expression):
            if selector.metric in recorded:
                continue
            series = api.series(selector.metric)
            assert series, f"{selector.metric} (in {expression!r}) was never scraped"
            labels = {label for one in series for label in one}
            seen_labels |= labels
            missing = selector.labels - labels
            assert not missing, f"{selector.metric} has no label {sorted(missing)} (in {expression!r})"
        grouped = grouping_labels(expression) - made_by_label_replace(expression) - TARGET_LABELS
        if seen_labels:
            assert grouped <= seen_labels, f"{sorted(grouped - seen_labels)} not scraped (in {expression!r})"


def check_queries_return_series(api: PrometheusApi) -> None:
    expressions = [rule["record"] for rule in recording_rules()] + dashboard_expressions()
    # The SLI names its API family (label_replace on the method), here the memory RPCs driven.
    expressions.append('tokensvc:slo_error_ratio:rate5m{family="MemoryService"}')

    def empty() -> list[str]:
        return [expression for expression in expressions if not api.query(expression)]

    deadline = time.monotonic() + 60
    while (still_empty := empty()) and time.monotonic() < deadline:
        time.sleep(1)
    assert still_empty == [], f"no series for {still_empty}"
