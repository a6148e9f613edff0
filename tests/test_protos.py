"""The committed stubs are exactly what `make proto` generates from protos/ (but for the
generator's version stamps), and the pinned runtimes satisfy those stamps."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_committed_stubs_equal_freshly_generated_ones(tmp_path: Path) -> None:
    bin_dir = Path(sys.executable).parent
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "protos/tokensvc/v1").glob("*.proto"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            "protos",
            f"--plugin=protoc-gen-mypy={shutil.which('protoc-gen-mypy', path=str(bin_dir))}",
            f"--plugin=protoc-gen-mypy_grpc={shutil.which('protoc-gen-mypy_grpc', path=str(bin_dir))}",
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            f"--mypy_out={tmp_path}",
            f"--mypy_grpc_out={tmp_path}",
            *protos,
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    generated = {p.name: unstamped(p.read_bytes()) for p in (tmp_path / "tokensvc/v1").iterdir()}
    committed = {
        p.name: unstamped(p.read_bytes())
        for p in (ROOT / "tokensvc/v1").iterdir()
        if p.name != "__init__.py" and p.is_file()
    }
    stale = sorted(
        name for name in generated.keys() | committed.keys() if generated.get(name) != committed.get(name)
    )
    assert not stale, f"stale stubs (run `make proto`): {stale}"


# What a stub says about the generator that wrote it, not about the protos: a grpcio-tools or
# protobuf release changes it in every file. The stubs then require at least these runtimes
# (they check at import); `test_the_pinned_lower_bounds_cover_the_stubs_runtime_checks` keeps
# pyproject.toml's lower bounds there.
_GRPC_STAMP = re.compile(rb"^GRPC_GENERATED_VERSION = '([0-9.]+)'$", re.MULTILINE)
_PROTOBUF_STAMP = re.compile(
    rb"^# Protobuf Python Version: ([0-9.]+)$|_runtime_version\.Domain\.PUBLIC,\s+(\d+),\s+(\d+),\s+(\d+),",
    re.MULTILINE,
)


def unstamped(stub: bytes) -> bytes:
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
