"""The monitoring component as the tests see it: the rendered PrometheusRule and dashboard, the
metric and label names their PromQL uses, and the Prometheus binaries from Debian's `prometheus`
package (required, not optional: `.ci/run` installs the package when it is missing).
"""

from __future__ import annotations

import functools
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.rendering import one, render

__all__ = [
    "UNIT_TESTS",
    "Selector",
    "alerts",
    "dashboard",
    "dashboard_expressions",
    "grouping_labels",
    "prometheus_binary",
    "recording_rules",
    "rule_expressions",
    "selectors",
    "write_rules",
]

UNIT_TESTS = Path(__file__).with_name("alerts.test.yaml")

Rule = dict[str, Any]


def prometheus_binary(name: str) -> str:
    """`promtool` or `prometheus`, from Debian's `prometheus` package."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"{name} is not installed; the monitoring tests run it. It comes with Debian's "
            "`prometheus` package: `sudo apt-get install --no-install-recommends prometheus` "
            "(.ci/run installs it on CI machines that lack it)."
        )
    return path


@functools.cache
def _rules_spec() -> str:
    rule = one(render("prod"), "PrometheusRule", "tokensvc")
    return str(yaml.safe_dump(rule["spec"], sort_keys=False))


def write_rules(directory: Path) -> Path:
    """The PrometheusRule's spec as a Prometheus rules file (what the operator hands Prometheus)."""
    path = directory / "rules.yaml"
    path.write_text(_rules_spec(), encoding="utf-8")
    return path


def _rules() -> list[Rule]:
    spec = yaml.safe_load(_rules_spec())
    return [rule for group in spec["groups"] for rule in group["rules"]]


def alerts() -> list[Rule]:
    return [rule for rule in _rules() if "alert" in rule]


def recording_rules() -> list[Rule]:
    return [rule for rule in _rules() if "record" in rule]


def rule_expressions() -> list[str]:
    return [rule["expr"] for rule in _rules()]


def dashboard() -> dict[str, Any]:
    config_map = one(render("prod"), "ConfigMap", "tokensvc-dashboard")
    return dict(json.loads(config_map["data"]["tokensvc.json"]))


def dashboard_expressions() -> list[str]:
    return [target["expr"] for panel in dashboard()["panels"] for target in panel.get("targets", [])]


@dataclass(frozen=True)
class Selector:
    """One metric named in PromQL, with the labels its matchers name."""

    metric: str
    labels: frozenset[str]


# A metric name (tokensvc_* or a tokensvc:* recording rule, or `up`) and its optional matchers.
_SELECTOR = re.compile(r"(?<![\w:.\[\"])(tokensvc[_:][a-z0-9_:]+|up)\b(\{[^}]*\})?")
_MATCHER = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)\s*\"")
_GROUPING = re.compile(r"\b(?:by|on|without)\s*\(([^)]*)\)")


def selectors(expression: str) -> list[Selector]:
    return [
        Selector(match[1], frozenset(_MATCHER.findall(match[2] or "")))
        for match in _SELECTOR.finditer(expression)
    ]


def grouping_labels(expression: str) -> set[str]:
    """Labels named in `by (...)`, `on (...)` and `without (...)`."""
    return {
        label.strip()
        for group in _GROUPING.findall(expression)
        for label in group.split(",")
        if label.strip()
    }
