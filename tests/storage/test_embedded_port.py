"""The embedded PostgreSQL takes another port when the free one it found is taken before the
postmaster binds it (another process on the machine got there first)."""

from __future__ import annotations

import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from tokensvc.storage.postgres import embedded
from tokensvc.storage.postgres.embedded import EmbeddedPostgres


async def test_a_port_taken_between_finding_and_binding_it_is_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    occupied = taken.getsockname()[1]
    ports = iter([occupied])
    real = embedded._free_port
    monkeypatch.setattr(embedded, "_free_port", lambda: next(ports, None) or real())
    # Outside pytest's basetemp (see tests/conftest.py `database`).
    directory = Path(tempfile.mkdtemp(prefix="tokensvc-port-"))
    server = EmbeddedPostgres(directory)
    try:
        await server.start()
        assert server.port not in (None, occupied)
        assert b"could not bind" in server.paths.log.read_bytes()
    finally:
        taken.close()
        await server.stop()
        shutil.rmtree(directory, ignore_errors=True)
