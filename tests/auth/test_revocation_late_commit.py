"""A revocation that becomes visible long after its `revoked_at` (a slow commit, a restored or
operator-inserted row) is still honoured, on the real database: announced at its commit
(LISTEN/NOTIFY) and applied at once; without announcements, the poller's periodic full resync picks
it up within `full_sync_seconds + poll_seconds`."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg

from tests.support import SharedDatabase, superuser
from tokensvc.auth.revocation import RevocationList
from tokensvc.credentials import FileCredentialSource
from tokensvc.storage.postgres.revocations import PostgresRevocationStore

FEED_APPLICATION = "revocation-feed-test"


async def test_a_revocation_visible_after_the_poll_window_is_picked_up_by_the_full_resync(
    database: SharedDatabase,
) -> None:
    pool = await asyncpg.create_pool(
        database.dsn,
        user=FileCredentialSource(database.app_credential_dir).read().username,
        password=FileCredentialSource(database.app_credential_dir).read().password,
        min_size=1,
        max_size=2,
        server_settings={"search_path": "tokensvc, public"},
    )
    now = [1000.0]
    revocations = RevocationList(
        PostgresRevocationStore(pool), poll_seconds=1.0, full_sync_seconds=10.0, clock=lambda: now[0]
    )
    try:
        await revocations.start()
        await revocations.stop()  # the test drives the polls
        # Another replica revokes a token now: this replica's newest-seen moves to now.
        newer = f"jti-{uuid.uuid4()}"
        await PostgresRevocationStore(pool).revoke("jti", newer, reason="", revoked_by="test")
        now[0] += 1
        await revocations.poll_once()
        assert revocations.is_revoked(newer, "-")
        # A revocation whose row becomes visible with a revoked_at 36 s in the past (a commit that
        # waited, a restore): outside the incremental window.
        late = f"jti-{uuid.uuid4()}"
        async with superuser(database) as owner:
            await owner.execute(
                "INSERT INTO tokensvc.capability_revocations (kind, value, revoked_by, revoked_at) "
                "VALUES ('jti', $1, 'test', clock_timestamp() - interval '36 seconds')",
                late,
            )
        now[0] += 1
        await revocations.poll_once()
        assert not revocations.is_revoked(late, "-"), "the incremental poll was expected to miss it"
        now[0] += 9  # 10 s since the last full sync
        await revocations.poll_once()
        assert revocations.is_revoked(late, "-")
    finally:
        await pool.close()


@asynccontextmanager
async def listening_list(database: SharedDatabase, **timing: Any) -> AsyncIterator[RevocationList]:
    """A started RevocationList on the real database that LISTENs for announcements on a
    connection of its own (application name `revocation-feed-test`); stopped afterwards."""
    credential = FileCredentialSource(database.app_credential_dir).read()
    login: dict[str, Any] = {
        "user": credential.username,
        "password": credential.password,
        "server_settings": {"search_path": "tokensvc, public", "application_name": FEED_APPLICATION},
    }
    pool = await asyncpg.create_pool(database.dsn, **login, min_size=1, max_size=2)

    async def own_connection() -> asyncpg.Connection:
        return await asyncpg.connect(database.dsn, **login)

    revocations = RevocationList(PostgresRevocationStore(pool, own_connection), **timing)
    try:
        await revocations.start()
        yield revocations
    finally:
        await revocations.stop()
        await pool.close()


async def test_a_revocation_is_announced_when_it_commits_however_late_and_applies_without_a_poll(
    database: SharedDatabase,
) -> None:
    now = [1000.0]
    async with listening_list(
        database, poll_seconds=5.0, full_sync_seconds=3600.0, clock=lambda: now[0]
    ) as revocations:
        assert revocations.is_listening
        late = f"jti-{uuid.uuid4()}"
        async with superuser(database) as operator:
            # An operator's INSERT whose commit waits: the row says it was revoked 36 s ago.
            async with operator.transaction():
                await operator.execute(
                    "INSERT INTO tokensvc.capability_revocations (kind, value, revoked_by, revoked_at) "
                    "VALUES ('jti', $1, 'test', clock_timestamp() - interval '36 seconds')",
                    late,
                )
                await asyncio.sleep(0.5)
                assert not revocations.is_revoked(late, "-"), "nothing is announced before the commit"
            committed = time.monotonic()
            while not revocations.is_revoked(late, "-"):
                assert time.monotonic() - committed < 2, "the announcement did not arrive"
                await asyncio.sleep(0.01)
        # No poll ran (the fake clock never moved, the poller sleeps 5 s): the announcement did it.
        assert now[0] == 1000.0


async def test_a_lost_announcement_connection_is_reopened_at_the_next_full_resync(
    database: SharedDatabase,
) -> None:
    now = [1000.0]
    async with listening_list(
        database, poll_seconds=1.0, full_sync_seconds=10.0, clock=lambda: now[0]
    ) as revocations:
        assert revocations.is_listening
        async with superuser(database) as operator:
            await operator.execute(
                # Its application name says which it is: the role's sessions show no query text
                # (track_activities is off for tokensvc's login roles).
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
                FEED_APPLICATION,
            )
        for _ in range(100):
            if not revocations.is_listening:
                break
            await asyncio.sleep(0.02)
        assert not revocations.is_listening
        now[0] += 10  # the next poll is a full resync: it listens again first
        await revocations.poll_once()
        assert revocations.is_listening
        again = f"jti-{uuid.uuid4()}"
        async with superuser(database) as operator:
            await operator.execute(
                "INSERT INTO tokensvc.capability_revocations (kind, value, revoked_by) VALUES ('jti', $1, 'test')",
                again,
            )
        began = time.monotonic()
        while not revocations.is_revoked(again, "-"):
            assert time.monotonic() - began < 2, "the reopened feed announced nothing"
            await asyncio.sleep(0.01)
