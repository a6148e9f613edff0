"""Repeats what the fault and load tests measured at the end of the run, so CI logs show it."""

from __future__ import annotations

from typing import Any

from tests.faults.harness import MEASUREMENTS


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if MEASUREMENTS:
        terminalreporter.section("fault and load measurements")
        for line in MEASUREMENTS:
            terminalreporter.write_line(line)
