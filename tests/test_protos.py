"""The committed stubs are exactly what `make proto` generates from protos/."""

from __future__ import annotations

import shutil
import subprocess
import sys
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
    generated = {p.name: p.read_bytes() for p in (tmp_path / "tokensvc/v1").iterdir()}
    committed = {
        p.name: p.read_bytes()
        for p in (ROOT / "tokensvc/v1").iterdir()
        if p.name != "__init__.py" and p.is_file()
    }
    stale = sorted(
        name for name in generated.keys() | committed.keys() if generated.get(name) != committed.get(name)
    )
    assert not stale, f"stale stubs (run `make proto`): {stale}"
