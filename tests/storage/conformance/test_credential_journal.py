"""CredentialJournal: a rotation opens at step `started`, records each step before it is taken and
closes with an outcome; a rotation that changed the credential gets the next credential version
(1 + the highest so far); the rotations a crash left open are found again, oldest first; and a
snapshot is one consistent read while rotations close. Every test starts from an empty journal.
"""

from __future__ import annotations

import asyncio
from datetime import datetime

from tokensvc.storage.ports import CredentialJournal
from tokensvc.storage.records import RotationEntry

Snapshot = tuple[int, datetime | None, RotationEntry | None]


async def open_one(journal: CredentialJournal, mode: str = "rotate") -> int:
    return await journal.begin(mode=mode, actor="admin", from_role="tokensvc_app_a", to_role="tokensvc_app_b")


async def rotation(
    journal: CredentialJournal, outcome: str, *, keep_version: bool = False, reason: str = ""
) -> tuple[int, int | None]:
    """One whole rotation: begun, a step, closed; its id and the version `close` returned."""
    rotation_id = await open_one(journal)
    await journal.step(rotation_id, "switch")
    version = await journal.close(
        rotation_id, outcome=outcome, reason=reason, step="completed", keep_version=keep_version
    )
    return rotation_id, version


async def latest(journal: CredentialJournal) -> RotationEntry:
    entry = (await journal.snapshot())[2]
    assert entry is not None
    return entry


async def test_an_empty_journal_is_at_version_zero_with_no_rotation(journal: CredentialJournal) -> None:
    assert await journal.snapshot() == (0, None, None)
    assert await journal.open_rotations() == []


async def test_begin_opens_a_rotation_in_progress_at_step_started(journal: CredentialJournal) -> None:
    rotation_id = await journal.begin(
        mode="reload", actor="admin-1", from_role="tokensvc_app_a", to_role="tokensvc_app_b"
    )

    [entry] = await journal.open_rotations()
    assert (entry.id, entry.mode, entry.actor, entry.from_role, entry.to_role) == (
        rotation_id,
        "reload",
        "admin-1",
        "tokensvc_app_a",
        "tokensvc_app_b",
    )
    assert (entry.step, entry.outcome, entry.reason, entry.version) == ("started", "in_progress", "", None)
    assert entry.started_at.tzinfo is not None
    assert entry.started_at <= entry.updated_at
    assert await journal.snapshot() == (0, None, entry)


async def test_rotation_ids_increase(journal: CredentialJournal) -> None:
    ids = [await open_one(journal) for _ in range(3)]
    ids.append((await rotation(journal, "succeeded"))[0])
    ids.append(await open_one(journal, "reload"))

    assert ids == sorted(set(ids))
    assert (await latest(journal)).id == ids[-1]


async def test_a_step_is_recorded_and_moves_updated_at(journal: CredentialJournal) -> None:
    rotation_id = await open_one(journal)
    started = await latest(journal)

    await journal.step(rotation_id, "set_password")

    stepped = await latest(journal)
    assert (stepped.id, stepped.step, stepped.outcome) == (rotation_id, "set_password", "in_progress")
    assert stepped.started_at == started.started_at
    assert stepped.updated_at > started.updated_at
    assert [e.step for e in await journal.open_rotations()] == ["set_password"]


async def test_a_rotation_that_changed_the_credential_gets_the_next_version(
    journal: CredentialJournal,
) -> None:
    first_id, first = await rotation(journal, "succeeded")

    version, rotated_at, entry = await journal.snapshot()
    assert first == version == 1
    assert entry is not None
    assert (entry.id, entry.outcome, entry.step, entry.version) == (first_id, "succeeded", "completed", 1)
    assert rotated_at == entry.updated_at

    second_id, second = await rotation(journal, "recovered", reason="rolled forward to tokensvc_app_b")

    version, rotated_at, entry = await journal.snapshot()
    assert second == version == 2
    assert entry is not None
    assert (entry.id, entry.outcome, entry.reason, entry.version) == (
        second_id,
        "recovered",
        "rolled forward to tokensvc_app_b",
        2,
    )
    assert rotated_at == entry.updated_at
    assert await journal.open_rotations() == []


async def test_a_failed_rotation_or_an_unchanged_credential_keeps_the_version(
    journal: CredentialJournal,
) -> None:
    await rotation(journal, "succeeded")
    before = await journal.snapshot()

    _, failed = await rotation(journal, "failed", reason="credential_invalid")
    failed_entry = await latest(journal)
    _, rolled_back = await rotation(journal, "recovered", keep_version=True)
    _, unchanged = await rotation(journal, "succeeded", keep_version=True)

    assert failed is rolled_back is unchanged is None
    assert (failed_entry.outcome, failed_entry.reason, failed_entry.version) == (
        "failed",
        "credential_invalid",
        None,
    )
    version, rotated_at, entry = await journal.snapshot()
    assert (version, rotated_at) == before[:2]
    assert entry is not None
    assert (entry.outcome, entry.version) == ("succeeded", None)
    # The next version is one above the highest so far, whatever closed in between.
    assert (await rotation(journal, "succeeded"))[1] == 2


async def test_close_keeps_the_last_step_unless_it_is_given_one(journal: CredentialJournal) -> None:
    failing = await open_one(journal)
    await journal.step(failing, "test_login")
    await journal.close(failing, outcome="failed", reason="credential_invalid")
    assert ((await latest(journal)).step, (await latest(journal)).outcome) == ("test_login", "failed")

    completing = await open_one(journal)
    await journal.step(completing, "switch")
    await journal.close(completing, outcome="succeeded", step="completed")
    assert ((await latest(journal)).step, (await latest(journal)).outcome) == ("completed", "succeeded")


async def test_rotations_a_crash_interrupted_stay_open_oldest_first_until_recovered(
    journal: CredentialJournal,
) -> None:
    interrupted = await open_one(journal)
    await journal.step(interrupted, "write_secret")
    finished, version = await rotation(journal, "succeeded")
    also_interrupted = await open_one(journal, "reload")
    await journal.step(also_interrupted, "test_login")

    found = await journal.open_rotations()

    assert version == 1
    assert [(e.id, e.mode, e.step, e.outcome) for e in found] == [
        (interrupted, "rotate", "write_secret", "in_progress"),
        (also_interrupted, "reload", "test_login", "in_progress"),
    ]
    assert finished not in {e.id for e in found}
    # Recovery closes them: one rolled back (the credential did not change), one rolled forward.
    assert (
        await journal.close(interrupted, outcome="recovered", reason="rolled back", keep_version=True) is None
    )
    assert await journal.close(also_interrupted, outcome="recovered", reason="rolled forward") == 2
    assert await journal.open_rotations() == []
    version, _, entry = await journal.snapshot()
    assert version == 2
    assert entry is not None
    assert (entry.id, entry.step, entry.outcome) == (also_interrupted, "test_login", "recovered")


async def test_a_snapshot_is_one_consistent_read_while_rotations_close(journal: CredentialJournal) -> None:
    """Rotations run one at a time (the rotation lock) while readers take snapshots: each shows the
    version in force together with the latest rotation, never one from before a close and the
    other from after it."""
    outcomes = [("succeeded", False), ("failed", False), ("recovered", True), ("recovered", False)]
    before: dict[int, int] = {}  # rotation id -> the version when it began
    after: dict[int, int] = {}  # rotation id -> the version once it closed
    done = asyncio.Event()

    async def rotate_repeatedly() -> None:
        version = 0
        for i in range(24):
            outcome, keep = outcomes[i % len(outcomes)]
            rotation_id = await open_one(journal)
            before[rotation_id] = version
            await asyncio.sleep(0)
            await journal.step(rotation_id, "switch")
            await asyncio.sleep(0)
            closed = await journal.close(rotation_id, outcome=outcome, keep_version=keep)
            version = version if closed is None else closed
            after[rotation_id] = version
            await asyncio.sleep(0)
        done.set()

    async def read_repeatedly() -> list[Snapshot]:
        seen = []
        while not done.is_set():
            seen.append(await journal.snapshot())
            await asyncio.sleep(0)
        return seen

    _, *readers = await asyncio.gather(rotate_repeatedly(), *(read_repeatedly() for _ in range(3)))

    set_at: dict[int, datetime | None] = {}
    states = set()
    for seen in readers:
        ids = [entry.id for _, _, entry in seen if entry is not None]
        assert ids == sorted(ids), "a reader never goes back to an older rotation"
        for version, rotated_at, entry in seen:
            if entry is None:
                assert (version, rotated_at) == (0, None)
                continue
            states.add(entry.outcome == "in_progress")
            expected = before[entry.id] if entry.outcome == "in_progress" else after[entry.id]
            assert version == expected, (entry, version)
            if entry.version is not None:
                assert (version, rotated_at) == (entry.version, entry.updated_at)
            assert set_at.setdefault(version, rotated_at) == rotated_at
    assert states == {True, False}, "readers saw rotations both open and closed"
    version, rotated_at, entry = await journal.snapshot()
    assert entry is not None
    assert (version, entry.id) == (after[max(after)], max(after))
    assert rotated_at == set_at.get(version, rotated_at)
