"""The caller's deadline, carried to storage so a query never outlives the RPC it serves.

The edge records `time.monotonic()`-based deadlines from gRPC; a tenant transaction turns the
remaining time into a transaction-local `statement_timeout`, and gRPC cancelling the handler task
cancels the query too (asyncpg sends PostgreSQL a cancel request).
"""

from __future__ import annotations

import contextvars
import time

__all__ = ["current_deadline", "remaining_ms", "reset_deadline", "use_deadline"]

_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("tokensvc_deadline", default=None)


def use_deadline(seconds_remaining: float | None) -> contextvars.Token[float | None]:
    deadline = None if seconds_remaining is None else time.monotonic() + seconds_remaining
    return _DEADLINE.set(deadline)


def reset_deadline(token: contextvars.Token[float | None]) -> None:
    _DEADLINE.reset(token)


def current_deadline() -> float | None:
    return _DEADLINE.get()


def remaining_ms() -> int | None:
    """Milliseconds left (at least 1), or None when the caller set no deadline."""
    deadline = _DEADLINE.get()
    if deadline is None:
        return None
    return max(1, int((deadline - time.monotonic()) * 1000))
