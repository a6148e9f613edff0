"""The monitoring component's rules, alerts and dashboard, checked without a running Prometheus:
promtool's syntax check and unit tests, a runbook section per alert, the ServiceMonitor aimed at
the metrics port, and every name the PromQL uses exported by tokensvc's own registry.
(tests/monitoring/test_prometheus.py checks the same names against a real scrape.)
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml
from prometheus_client import REGISTRY

from tests.deploy.rendering import ROOT, one, render
from tests.monitoring.rules import (
    UNIT_TESTS,
    alerts,
    dashboard,
    dashboard_expressions,
    prometheus_binary,
    recording_rules,
    rule_expressions,
    selectors,
    write_rules,
)
from tokensvc.observability import METRICS
from tokensvc.observability.metrics import Vitals

RUNBOOK = "https://github.com/ctxmesh/tokensvc/blob/main/docs/operations.md#"
# Sample names each metric type exposes besides its family name.
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [prometheus_binary("promtool"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a document's headings (lowercase, punctuation dropped, spaces to -)."""
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", markdown, flags=re.MULTILINE):
        anchors.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return anchors


def test_the_rules_pass_promtool_check(tmp_path: Path) -> None:
    rules = write_rules(tmp_path)
    result = promtool("check", "rules", str(rules), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts()) + len(recording_rules())} rules found" in result.stdout


def test_every_alert_fires_and_stays_quiet_in_the_promtool_unit_tests(tmp_path: Path) -> None:
    write_rules(tmp_path)
    shutil.copy(UNIT_TESTS, tmp_path / UNIT_TESTS.name)
    cases = [
        case for test in yaml.safe_load(UNIT_TESTS.read_text())["tests"] for case in test["alert_rule_test"]
    ]
    for alert in alerts():
        name = alert["alert"]
        outcomes = [bool(case["exp_alerts"]) for case in cases if case["alertname"] == name]
        assert True in outcomes, f"{name}: no unit test where it fires"
        assert False in outcomes, f"{name}: no unit test where it stays quiet"
    assert {case["alertname"] for case in cases} <= {alert["alert"] for alert in alerts()}

    result = promtool("test", "rules", UNIT_TESTS.name, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_has_a_severity_a_summary_and_a_runbook_section_in_operations_md() -> None:
    anchors = github_anchors((ROOT / "docs" / "operations.md").read_text(encoding="utf-8"))
    assert alerts()
    for alert in alerts():
        name = alert["alert"]
        assert re.fullmatch(r"Tokensvc[A-Z][A-Za-z]+", name)
        assert alert["labels"]["severity"] in {"critical", "warning"}, name
        assert alert["annotations"]["summary"], name
        assert alert["annotations"]["description"], name
        url = alert["annotations"]["runbook_url"]
        assert url.startswith(RUNBOOK), url
        anchor = url.removeprefix(RUNBOOK)
        assert anchor == name.lower(), f"{name}: the runbook section is its name"
        assert anchor in anchors, f"{name}: docs/operations.md has no section #{anchor}"


def test_the_service_monitor_scrapes_the_services_metrics_port() -> None:
    resources = render("prod")
    monitor = one(resources, "ServiceMonitor", "tokensvc")
    service = one(resources, "Service", "tokensvc")
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [service["metadata"]["namespace"]]
    ports = {port["name"]: port["port"] for port in service["spec"]["ports"]}
    assert [endpoint["port"] for endpoint in monitor["spec"]["endpoints"]] == ["metrics"]
    assert "metrics" in ports
    # The alerts select job="tokensvc": the prometheus-operator names the job after the Service.
    assert service["metadata"]["name"] == "tokensvc"
    assert "jobLabel" not in monitor["spec"]
    assert any('job="tokensvc"' in expression for expression in rule_expressions())


def test_the_dashboard_is_labelled_for_the_grafana_sidecar_and_every_panel_queries() -> None:
    config_map = one(render("prod"), "ConfigMap", "tokensvc-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    board = dashboard()
    assert board["uid"] == "tokensvc"
    assert [v["name"] for v in board["templating"]["list"]] == ["datasource"]
    graphs = [panel for panel in board["panels"] if panel["type"] != "row"]
    assert len({panel["id"] for panel in board["panels"]}) == len(board["panels"])
    for panel in graphs:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        assert all(target["expr"] for target in panel["targets"]), panel["title"]
    titles = " ".join(panel["title"].lower() for panel in graphs)
    for topic in (
        "rpcs",
        "errors",
        "latency",
        "capability",
        "cache",
        "pool",
        "embedder",
        "batch",
        "memories",
        "credential",
    ):
        assert topic in titles, f"no panel about {topic}"


def test_every_metric_the_rules_and_dashboard_use_is_exported_or_recorded() -> None:
    METRICS.initialise(["hash"])
    # The live gauges of a running service (what app.Service registers), here without one.
    unwatch = METRICS.live.watch(
        lambda: Vitals(1, 0, 10, serving=True, revocation_age_seconds=0.5, revocation_max_staleness_seconds=5)
    )
    try:
        exported = {
            family.name + suffix
            for family in REGISTRY.collect()
            for suffix in SUFFIXES.get(family.type, ("",))
        }
    finally:
        unwatch()
    recorded = {rule["record"] for rule in recording_rules()}
    used = {
        s.metric
        for expression in [*rule_expressions(), *dashboard_expressions()]
        for s in selectors(expression)
    }
    assert used - exported - recorded - {"up"} == set()
    # Every recording rule is used by an alert or the dashboard, and every alert's input exists.
    alert_inputs = {s.metric for alert in alerts() for s in selectors(alert["expr"])}
    dashboard_inputs = {s.metric for expression in dashboard_expressions() for s in selectors(expression)}
    assert recorded - alert_inputs - dashboard_inputs == set()
