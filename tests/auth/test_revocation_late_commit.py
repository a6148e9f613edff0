"""A revocation that becomes visible long after its `revoked_at` (a slow commit, a restored or
operator-inserted row) is still honoured: the poller's periodic full resync picks it up, on the real
database, within `full_sync_seconds + poll_seconds`."""

from __future__ import annotations

import uuid

import asyncpg

from tests.support import SharedDatabase, superuser
from tokensvc.auth.revocation import RevocationList
from tokensvc.credentials import FileCredentialSource
from tokensvc.storage.postgres.revocations import PostgresRevocationStore


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
