"""Transactions bound to a tenant: the second wall behind every query's own bucket predicate.

Row-level security policies read `tokensvc.buckets`, `tokensvc.namespace`, `tokensvc.agent` and
`tokensvc.kbs`; we set them with `set_config(..., true)`, which lasts only until the transaction
ends, so a pooled connection never carries a request's tenant into the next one. That is also why
the pool needs no reset query on release (`Database.open_pool`): nothing tokensvc sets outlives
its transaction, and a test checks it.

The transaction start and the tenant declaration travel as ONE simple-protocol message
(`BEGIN ...; SELECT set_config(...)`), so a search costs three round trips: that message, the
query, COMMIT. The values are written as literals, which is safe because each one is checked
first: `Tenant` validates every field, the other settings are our own constants and numbers, and
`_literal` refuses a quote-breaking character anyway.

On Citus the shards' policies run on the workers, where a coordinator's `set_config` never
arrives: Citus forwards only `SET LOCAL` statements, and only with `citus.propagate_set_commands
= 'local'`, replaying each statement's text when it opens a transaction on a worker. So a
connection of a distributed database (`DistributedConnection`, chosen by `Database`) declares the
settings as `SET LOCAL`s inside a `DO` block. The block matters: Citus forwards the text of the
message a top-level SET came in, so a SET in the `BEGIN ...` message would send the BEGIN, the lock
and the checks to the workers too; inside the block each SET is a statement of its own text. The
lock and the checks then follow in a message of their own (one more round trip, on Citus only).
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager

import asyncpg

from tokensvc.observability.deadlines import remaining_ms
from tokensvc.storage.postgres.errors import database_errors
from tokensvc.storage.records import Tenant

__all__ = [
    "DistributedConnection",
    "declare",
    "declare_settings",
    "distributed_pool",
    "is_distributed",
    "literal",
    "tenant_transaction",
]

_log = logging.getLogger(__name__)

_ACQUIRE_CEILING_S = 30.0
_ISOLATION = {
    "read_committed": "READ COMMITTED",
    "repeatable_read": "REPEATABLE READ",
    "serializable": "SERIALIZABLE",
}


# A setting's name, written into SQL as it is: ours are constants such as `tokensvc.buckets`.
_SETTING_NAME = re.compile(r"[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)?")
# The DO block's quote; no value may hold a `$`, so none can end the block.
_BLOCK = "$tokensvc_tenant$"


class DistributedConnection(asyncpg.Connection):
    """A connection to a Citus coordinator: tenant settings are declared so the workers see them."""

    distributed = True


def distributed_pool(pool: asyncpg.Pool) -> bool:
    """Whether a pool's connections reach a Citus coordinator (`Database` opens such a pool with
    `DistributedConnection`; asyncpg keeps the class on the pool, not public)."""
    connection_class = getattr(pool, "_connection_class", asyncpg.Connection)
    return isinstance(connection_class, type) and issubclass(connection_class, DistributedConnection)


def is_distributed(conn: asyncpg.Connection | asyncpg.pool.PoolConnectionProxy) -> bool:
    """Whether `conn` reaches a distributed (Citus) database; a pooled proxy answers for its
    connection."""
    return getattr(conn, "distributed", False) is True


def literal(value: str) -> str:
    """A string literal for a value already validated by its owner (defence in depth)."""
    if "\\" in value or "\x00" in value:
        raise ValueError("not a value for a session setting")
    return "'" + value.replace("'", "''") + "'"


def _isolation(isolation: str, *, distributed: bool) -> str:
    """The isolation level named; `one_snapshot`: every statement reads the transaction's first
    snapshot (REPEATABLE READ, which a read-only transaction gets without serialization
    failures), or on Citus READ COMMITTED, whose callers run one statement after a count."""
    if isolation == "one_snapshot":
        return _ISOLATION["read_committed" if distributed else "repeatable_read"]
    return _ISOLATION[isolation]


def _begin(
    tenant: Tenant,
    isolation: str,
    settings: Mapping[str, str],
    timeout_ms: int | None,
    lock: str | None,
    checks: Sequence[str],
    *,
    distributed: bool = False,
) -> list[str]:
    """The messages that open the transaction: one, or on Citus two when a lock or checks follow."""
    if any(name.startswith("tokensvc.") for name in settings):
        raise ValueError("the tenant settings come from the Tenant only")
    values = {
        "tokensvc.buckets": ",".join(tenant.buckets),
        "tokensvc.namespace": tenant.namespace,
        "tokensvc.agent": tenant.agent,
        "tokensvc.kbs": ",".join(tenant.knowledge_bases),
        **settings,
    }
    if tenant.generation is not None:
        values["tokensvc.generation"] = str(tenant.generation)
    if tenant.dual_write is not None:
        values["tokensvc.dual_write"] = tenant.dual_write
    # The caller's deadline bounds every statement; without one the server default stays.
    if timeout_ms is not None:
        values["statement_timeout"] = str(max(1, timeout_ms))
    begin = (
        f"BEGIN ISOLATION LEVEL {_isolation(isolation, distributed=distributed)}; "
        f"{declare_settings(values, distributed=distributed)}"
    )
    after = list(checks)
    if lock is not None:
        # The key's text travels hex-encoded: any characters (a document ref may hold quotes and
        # backslashes) become a literal of [0-9a-f] only, and the lock id is the text's hash.
        key = f"convert_from(decode('{lock.encode('utf-8').hex()}', 'hex'), 'UTF8')"
        after.insert(0, f"SELECT pg_advisory_xact_lock(hashtextextended({key}, 0))")
    if distributed and after:
        return [begin, "; ".join(after)]
    return ["; ".join([begin, *after])]


def declare_settings(settings: Mapping[str, str], *, distributed: bool = False) -> str:
    """The statements setting these transaction-local settings (names are our own constants):
    `set_config(..., true)` calls, or on Citus `SET LOCAL`s that reach the workers too."""
    if not distributed:
        return "SELECT " + ", ".join(
            f"set_config({literal(k)}, {literal(v)}, true)" for k, v in settings.items()
        )
    for name, value in settings.items():
        if not _SETTING_NAME.fullmatch(name) or "$" in value:
            raise ValueError("not a setting to declare")
    sets = " ".join(f"SET LOCAL {name} = {literal(value)};" for name, value in settings.items())
    return f"SET LOCAL citus.propagate_set_commands = 'local'; DO {_BLOCK} BEGIN {sets} END {_BLOCK}"


async def declare(
    conn: asyncpg.Connection | asyncpg.pool.PoolConnectionProxy, settings: Mapping[str, str]
) -> None:
    """Declare more transaction-local settings in the transaction `conn` is in."""
    await conn.execute(declare_settings(settings, distributed=is_distributed(conn)))


@asynccontextmanager
async def tenant_transaction(
    pool: asyncpg.Pool,
    tenant: Tenant,
    *,
    isolation: str = "read_committed",
    settings: Mapping[str, str] | None = None,
    lock: str | None = None,
    checks: Sequence[str] = (),
) -> AsyncIterator[asyncpg.Connection]:
    """A transaction bound to `tenant`; `settings` are more transaction-local settings (e.g. the
    HNSW scan's) and `lock` names a transaction-scoped advisory lock to wait for, both in the
    same message, so they cost no extra round trip; so are `checks`, statements of this package
    (their values written with `literal`) that fail the transaction's start when an expectation
    of the caller no longer holds. `isolation`: read_committed, repeatable_read, serializable,
    or one_snapshot (`_isolation`).

    Commits when the block ends normally, rolls back when it raises (or is cancelled); a
    connection whose rollback fails is closed, never returned to the pool mid-transaction.
    """
    # Waiting for a connection is bounded too: by the caller's deadline, else a fixed ceiling, so a
    # hung database cannot queue requests forever (the wait ends as UNAVAILABLE).
    left = remaining_ms()
    wait = _ACQUIRE_CEILING_S if left is None else min(left / 1000, _ACQUIRE_CEILING_S)
    # Failures of the block too are translated here (a lost connection, a statement cancelled
    # by the deadline), so any caller of a tenant transaction gets domain errors.
    with database_errors():
        async with pool.acquire(timeout=wait) as conn:
            left = remaining_ms()
            try:
                messages = _begin(
                    tenant, isolation, settings or {}, left, lock, checks, distributed=is_distributed(conn)
                )
                for message in messages:
                    await conn.execute(message)
                yield conn  # type: ignore[misc]
            except BaseException:
                await _rollback(conn)
                raise
            await conn.execute("COMMIT")


async def _rollback(conn: asyncpg.Connection | asyncpg.pool.PoolConnectionProxy) -> None:
    if conn.is_closed():
        return
    try:
        await conn.execute("ROLLBACK")
    except BaseException as exc:
        # The block's own error is what the caller sees; this connection is not reused.
        _log.warning("rollback failed (%s); closing the connection", type(exc).__name__)
        conn.terminate()
        if not isinstance(exc, Exception):
            raise
