"""A revocation announcement is only a hint (issue 35, F15). Any database role may NOTIFY on the
revocations' channel, so a replica reads the row an announcement names before it honours it, and
its incremental poll follows the database's clock, never a `revoked_at` from an announcement or
a row. Announcements are forged here with `pg_notify` as the serving login role."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Collection
from datetime import UTC, datetime

import asyncpg
import pytest

from tests.auth.test_revocation_late_commit import listening_list
from tests.support import SharedDatabase, connect_as, superuser
from tokensvc.auth.revocation import RevocationList
from tokensvc.storage.inprocess.ledgers import InProcessRevocationStore
from tokensvc.storage.records import Revocation, RevocationKind

FAR_FUTURE = datetime(2999, 1, 1, tzinfo=UTC)


def fresh(label: str) -> str:
    return f"{label}-{uuid.uuid4().hex}"


async def announce(
    conn: asyncpg.Connection, kind: str, value: str, revoked_at: datetime | None = None
) -> None:
    """What migration 0012's trigger sends, sent by hand: no row behind it."""
    await conn.execute(
        "SELECT pg_notify('tokensvc_revocations', json_build_object('kind', $1::text, 'value', $2::text,"
        " 'revoked_at', coalesce($3::timestamptz, now()))::text)",
        kind,
        value,
        revoked_at,
    )


async def insert(conn: asyncpg.Connection, value: str, revoked_at: datetime | None = None) -> None:
    """A real revocation row, as the serving role can write one (announced by the trigger)."""
    await conn.execute(
        "INSERT INTO capability_revocations (kind, value, revoked_by, revoked_at)"
        " VALUES ('jti', $1, 'test', coalesce($2::timestamptz, clock_timestamp()))",
        value,
        revoked_at,
    )


async def until_revoked(revocations: RevocationList, jti: str) -> None:
    began = time.monotonic()
    while not revocations.is_revoked(jti, "-"):
        assert time.monotonic() - began < 2, "the announcement did not arrive"
        await asyncio.sleep(0.01)


async def test_a_forged_announcement_revokes_nothing(database: SharedDatabase) -> None:
    now = [1000.0]
    async with listening_list(
        database, poll_seconds=5.0, full_sync_seconds=3600.0, clock=lambda: now[0]
    ) as revocations:
        forged_jti, forged_run, real = fresh("forged-jti"), fresh("forged-run"), fresh("real")
        async with connect_as(database.app_credential_dir, database.dsn) as serving:
            await announce(serving, "jti", forged_jti)
            await announce(serving, "run", forged_run)
            # Announcements reach a listener in commit order: once a revocation committed after
            # the forged ones is honoured, those have been handled too.
            await insert(serving, real)
        await until_revoked(revocations, real)
        assert not revocations.is_revoked(forged_jti, "-")
        assert not revocations.is_revoked("-", forged_run)


@pytest.mark.parametrize("source", ["forged-announcement", "real-row"])
async def test_a_far_future_revoked_at_does_not_move_the_poll_watermark(
    database: SharedDatabase, source: str
) -> None:
    now = [1000.0]
    async with listening_list(
        database, poll_seconds=5.0, full_sync_seconds=3600.0, clock=lambda: now[0]
    ) as revocations:
        future, marker, silent = fresh("future"), fresh("marker"), fresh("silent")
        async with connect_as(database.app_credential_dir, database.dsn) as serving:
            if source == "forged-announcement":
                await announce(serving, "jti", future, FAR_FUTURE)
            else:
                await insert(serving, future, FAR_FUTURE)
            await insert(serving, marker)
        await until_revoked(revocations, marker)
        assert revocations.is_revoked(future, "-") == (source == "real-row")
        # A revocation nobody announces (triggers off, as for a replicated or restored row): only
        # the incremental poll can find it, and it must still look at the present.
        async with superuser(database) as operator, operator.transaction():
            await operator.execute("SET LOCAL session_replication_role = replica")
            await insert(operator, silent)
        now[0] += 1  # an incremental poll, not a full resync
        await revocations.poll_once()
        assert revocations.is_revoked(silent, "-")


async def test_a_malformed_announcement_is_dropped_and_the_feed_keeps_working(
    database: SharedDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    async with listening_list(database, poll_seconds=5.0, full_sync_seconds=3600.0) as revocations:
        real = fresh("real")
        async with connect_as(database.app_credential_dir, database.dsn) as serving:
            for payload in ("[" * 7000, "{}", '{"kind": "jti", "value": 7}', "not json", "x" * 7999):
                await serving.execute("SELECT pg_notify('tokensvc_revocations', $1)", payload)
            await insert(serving, real)
        await until_revoked(revocations, real)
        assert revocations.is_listening
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.records


class SlowFind(InProcessRevocationStore):
    """Reading rows back takes a moment, as a database round trip does, so a flood piles up."""

    async def find(self, keys: Collection[tuple[RevocationKind, str]]) -> list[Revocation]:
        await asyncio.sleep(0.05)
        return await super().find(keys)


async def test_a_flood_of_forged_announcements_does_not_drop_a_real_one() -> None:
    """Past 1,024 announcements waiting to be read back, the list reads every row since its
    watermark instead: the real revocation announced in the flood is found by that read (the
    periodic poll, an hour away here, plays no part)."""
    store = SlowFind()
    revocations = RevocationList(store, poll_seconds=3600.0)
    await revocations.start()
    try:
        for i in range(1100):
            store.announce("jti", f"forged-{i}")
        await asyncio.sleep(0)  # the reader took the first batch; the flood goes on
        for i in range(1100):
            store.announce("jti", f"forged-again-{i}")
        await store.revoke("jti", "real", reason="stolen", revoked_by="test")
        for _ in range(500):
            if revocations.is_revoked("real", "-"):
                break
            await asyncio.sleep(0.01)
        assert revocations.is_revoked("real", "-")
        assert not revocations.is_revoked("forged-7", "-")
    finally:
        await revocations.stop()
