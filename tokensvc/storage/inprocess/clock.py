"""The in-process stores' clock: readings strictly increase, like PostgreSQL's `clock_timestamp()`.

PostgreSQL's timestamps have microsecond resolution; so do these. Two readings never tie, so the
items of one insert are created in order and an operation's "now" is later than any timestamp
written before it (a TTL of 0 is expired for every later call, as it is for every later
transaction in PostgreSQL).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

__all__ = ["Clock", "StoreClock"]

Clock = Callable[[], datetime]
"""A source of timezone-aware wall-clock time (tests pass one they can move forward)."""

_TICK = timedelta(microseconds=1)


def _utc_now() -> datetime:
    return datetime.now(UTC)


class StoreClock:
    """Strictly increasing, timezone-aware, microsecond readings of `source`."""

    def __init__(self, source: Clock | None = None):
        self._source = source or _utc_now
        self._last: datetime | None = None

    def now(self) -> datetime:
        reading = self._source().astimezone(UTC)
        if self._last is not None and reading <= self._last:
            reading = self._last + _TICK
        self._last = reading
        return reading
