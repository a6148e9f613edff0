"""A job's progress as an operator reads it: its rate so far and when it would end at that rate."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

__all__ = ["Throughput"]


@dataclass(frozen=True)
class Throughput:
    """Items done per second over the job's life so far (created to its last progress), and the
    seconds left at that rate (None: not running, or no rate yet)."""

    per_second: float
    eta_seconds: float | None

    @classmethod
    def of(
        cls, *, done: int, total: int, started: datetime | None, last: datetime | None, running: bool
    ) -> Throughput:
        rate = 0.0
        if started is not None and last is not None and done:
            elapsed = (last - started).total_seconds()
            rate = done / elapsed if elapsed > 0 else 0.0
        eta = max(0.0, total - done) / rate if running and rate > 0 else None
        return cls(rate, eta)
