"""Fixtures of the CLI tests: the server processes a test starts are stopped after it."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator

import pytest


@pytest.fixture
def process_cleanup() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes to stop (SIGINT, then SIGKILL after 30 s) when the test ends."""
    processes: list[subprocess.Popen[str]] = []
    yield processes
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
