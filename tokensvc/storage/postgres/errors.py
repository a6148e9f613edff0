"""Database failures as domain errors, by exception class (asyncpg's SQLSTATE classes, never text).

What the caller may act on is translated where the database is called, so nothing above storage
imports asyncpg:

- the connection is gone or cannot be made (class 08, the server shutting down, a pool wait that
  timed out, a socket error) -> `DatabaseUnavailable` (UNAVAILABLE, retry later);
- a statement cancelled by its timeout (57014, the caller's deadline) -> `DeadlineExceeded`;
- a memory write for a memory-space generation that is gone (TK001, the guard of migration
  0014) -> `StaleMemorySpace`, which the domain answers by embedding again;
- a transaction that lost to a concurrent one (class 40: a serialization failure, such as an
  UPDATE of a row another transaction moved to another partition of `memories`, or a deadlock)
  -> `DatabaseUnavailable` too: nothing was written, and the same call again succeeds.

Every other database error (a check or privilege violation: a bug, or row-level security doing
its job) passes through unchanged: the API edge answers it as INTERNAL with a generic message and
logs its type. `translate_errors` applies this to every public coroutine method of a store class;
`database_errors` to a block.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import asyncpg

from tokensvc.errors import ConcurrentChange, DatabaseUnavailable, DeadlineExceeded, TokensvcError
from tokensvc.storage.ports import StaleMemorySpace

__all__ = ["STALE_GENERATION", "database_errors", "domain_error", "translate_errors"]

# Raised by the memories generation guard (migration 0014): a write for a generation that is gone.
STALE_GENERATION = "TK001"

T = TypeVar("T")

# The connection is gone or cannot be made.
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    asyncpg.PostgresConnectionError,
    asyncpg.CannotConnectNowError,
    asyncpg.TooManyConnectionsError,
    asyncpg.InterfaceError,
    # The server ended the connection between two operations (its FATAL arrived while the
    # connection sat idle) and the next one finds the protocol mid-error (MagicStack/asyncpg#784).
    # The pool has already terminated that connection.
    asyncpg.InternalClientError,
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
    ConnectionError,
    OSError,
    # Waiting for a pooled connection (or a connect) outlasted its bound.
    asyncio.TimeoutError,
)


def domain_error(exc: BaseException) -> TokensvcError | None:
    """The domain error for a database failure, or None when `exc` is not one we translate."""
    if isinstance(exc, TokensvcError):
        return None
    if isinstance(exc, asyncpg.QueryCanceledError):
        return DeadlineExceeded("the operation was cancelled before it finished")
    if isinstance(exc, _UNAVAILABLE):
        return DatabaseUnavailable()
    if isinstance(exc, asyncpg.TransactionRollbackError):
        return ConcurrentChange()
    return None


@contextmanager
def database_errors() -> Iterator[None]:
    """Raise the domain error for a database failure in the block (the original as its cause)."""
    try:
        yield
    except Exception as exc:
        if isinstance(exc, asyncpg.PostgresError) and exc.sqlstate == STALE_GENERATION:
            raise StaleMemorySpace() from exc
        translated = domain_error(exc)
        if translated is None:
            raise
        raise translated from exc


def _translated(method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(method)
    async def call(*args: Any, **kwargs: Any) -> Any:
        with database_errors():
            return await method(*args, **kwargs)

    return call


def translate_errors(cls: type[T]) -> type[T]:
    """Class decorator: every public coroutine method raises domain errors for database failures."""
    for name, member in list(vars(cls).items()):
        if not name.startswith("_") and inspect.iscoroutinefunction(member):
            setattr(cls, name, _translated(member))
    return cls
