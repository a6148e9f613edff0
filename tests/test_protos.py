"""The committed client code is exactly what `buf generate` (buf.gen.yaml, `make proto`) writes
from protos/ (but for the generators' version stamps): the Python stubs (tokensvc/v1) and the Go
client's (clients/go/gen); and the pinned runtimes satisfy the Python stamps."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GENERATED = {  # where each language's code is committed, and which of its files are generated
    "tokensvc/v1": lambda p: p.name != "__init__.py",
    "clients/go/gen/tokensvc/v1": lambda p: p.name.endswith(".pb.go"),
}


def test_committed_code_equals_freshly_generated_code(tmp_path: Path) -> None:
    bin_dir = Path(sys.executable).parent
    for plugin in ("protoc-gen-go", "protoc-gen-go-grpc"):
        if shutil.which(plugin) is None:
            pytest.fail(f"`{plugin}` is not on PATH: run tools/setup-test-deps (as root)", pytrace=False)
    generated = subprocess.run(
        [str(bin_dir / "buf"), "generate", "--output", str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert generated.returncode == 0, generated.stderr
    for directory, is_generated in GENERATED.items():
        fresh = {p.name: unstamped(p.read_bytes()) for p in (tmp_path / directory).iterdir()}
        committed = {
            p.name: unstamped(p.read_bytes())
            for p in (ROOT / directory).iterdir()
            if p.is_file() and is_generated(p)
        }
        assert fresh, f"buf generate wrote nothing into {directory}"
        stale = sorted(
            name for name in fresh.keys() | committed.keys() if fresh.get(name) != committed.get(name)
        )
        assert not stale, f"stale generated code in {directory} (run `make proto`): {stale}"


# What a stub says about the generator that wrote it, not about the protos: a grpcio-tools or
# protobuf release changes it in every file. The stubs then require at least these runtimes
# (they check at import); `test_the_pinned_lower_bounds_cover_the_stubs_runtime_checks` keeps
# pyproject.toml's lower bounds there.
_GRPC_STAMP = re.compile(rb"^GRPC_GENERATED_VERSION = '([0-9.]+)'$", re.MULTILINE)
_PROTOBUF_STAMP = re.compile(
    rb"^# Protobuf Python Version: ([0-9.]+)$|_runtime_version\.Domain\.PUBLIC,\s+(\d+),\s+(\d+),\s+(\d+),",
    re.MULTILINE,
)
_GO_STAMP = re.compile(rb"^// \t(protoc-gen-go(?:-grpc)?|protoc) +\S.*$", re.MULTILINE)


def unstamped(stub: bytes) -> bytes:
    stub = _GO_STAMP.sub(rb"// \t\1 <version>", stub)
    return _PROTOBUF_STAMP.sub(b"<protobuf version>", _GRPC_STAMP.sub(b"<grpc version>", stub))


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def _lower_bound(package: str) -> tuple[int, ...]:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (bound,) = [d.split(">=")[1] for d in dependencies if d.split(">=")[0] == package]
    return _version(bound)


def test_the_pinned_lower_bounds_cover_the_stubs_runtime_checks() -> None:
    stubs = [p.read_bytes() for p in (ROOT / "tokensvc/v1").glob("*_pb2*.py")]
    grpc = {_version(m.decode()) for stub in stubs for m in _GRPC_STAMP.findall(stub)}
    protobuf = {_version(m[0].decode()) for stub in stubs for m in _PROTOBUF_STAMP.findall(stub) if m[0]}
    assert grpc, "no grpc generator stamp found: the pattern no longer matches the stubs"
    assert protobuf, "no protobuf generator stamp found: the pattern no longer matches the stubs"
    assert _lower_bound("grpcio") >= max(grpc), "pyproject's grpcio bound is below what the stubs check"
    assert _lower_bound("protobuf") >= max(protobuf), (
        "pyproject's protobuf bound is below what the stubs check"
    )
