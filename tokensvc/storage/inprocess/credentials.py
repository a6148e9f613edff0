"""Credential custody's stores in process memory: the rotation journal and a secret source (the
contracts: `tokensvc.storage.ports.CredentialJournal` and `CredentialSource`).

The journal holds what PostgreSQL's `credential_rotations` table holds (role names, steps and
outcomes, never a secret); no method yields between its reads and writes, so every call is one
consistent step, as a PostgreSQL transaction is. The secret source keeps one credential and
normalises it as `tokensvc.storage.secrets.FileCredentialSource` reads its files. Neither is
durable: after a restart the journal is empty and the source holds what it was given again.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from datetime import datetime

from tokensvc.errors import Reason, TokensvcError
from tokensvc.storage.inprocess.clock import Clock, StoreClock
from tokensvc.storage.records import DatabaseCredential, RotationEntry

__all__ = ["InProcessCredentialJournal", "InProcessCredentialSource"]

# The outcomes that put a credential version in force (unless the credential did not change).
_VERSIONED_OUTCOMES = ("succeeded", "recovered")


class InProcessCredentialJournal:
    """`CredentialJournal` over a dictionary; ids start at 1 and increase by one."""

    def __init__(self, clock: Clock | None = None):
        self._clock = StoreClock(clock)
        self._rotations: dict[int, RotationEntry] = {}  # by id, oldest first

    async def begin(self, *, mode: str, actor: str, from_role: str, to_role: str) -> int:
        at = self._clock.now()
        entry = RotationEntry(
            id=len(self._rotations) + 1,
            mode=mode,
            actor=actor,
            from_role=from_role,
            to_role=to_role,
            step="started",
            outcome="in_progress",
            reason="",
            version=None,
            started_at=at,
            updated_at=at,
        )
        self._rotations[entry.id] = entry
        return entry.id

    async def step(self, rotation_id: int, step: str) -> None:
        entry = self._rotations.get(rotation_id)
        if entry is not None:
            self._rotations[rotation_id] = replace(entry, step=step, updated_at=self._clock.now())

    async def close(
        self,
        rotation_id: int,
        *,
        outcome: str,
        reason: str = "",
        step: str | None = None,
        keep_version: bool = False,
    ) -> int | None:
        version = None
        if outcome in _VERSIONED_OUTCOMES and not keep_version:
            version = 1 + max(
                (e.version for e in self._rotations.values() if e.version is not None), default=0
            )
        entry = self._rotations.get(rotation_id)
        if entry is not None:
            self._rotations[rotation_id] = replace(
                entry,
                outcome=outcome,
                reason=reason,
                version=version,
                step=entry.step if step is None else step,
                updated_at=self._clock.now(),
            )
        return version

    async def open_rotations(self) -> list[RotationEntry]:
        return [e for e in self._rotations.values() if e.outcome == "in_progress"]

    async def snapshot(self) -> tuple[int, datetime | None, RotationEntry | None]:
        versioned = [e for e in self._rotations.values() if e.version is not None]
        current = max(versioned, key=lambda e: e.version or 0, default=None)
        latest = next(reversed(self._rotations.values()), None)
        if current is None or current.version is None:
            return 0, None, latest
        return current.version, current.updated_at, latest


class InProcessCredentialSource:
    """`CredentialSource` holding one credential (None: nothing written yet, like a secret whose
    files are missing). The stamp counts the writes. Reading trims what a secret file's reader
    trims (whitespace around the username, line breaks ending the password); a credential left
    empty is refused with CREDENTIAL_INVALID, as it is from files. A write replaces one reference,
    so a reader in any thread sees the old credential or the new one."""

    def __init__(self, credential: DatabaseCredential | None = None):
        self._writes = itertools.count(1)
        self._current: tuple[int, DatabaseCredential | None] = (0, credential)

    def __repr__(self) -> str:
        return "InProcessCredentialSource()"

    def read(self) -> DatabaseCredential:
        credential = self._current[1]
        if credential is None:
            raise TokensvcError(
                "no database credential has been written to this source", reason=Reason.CREDENTIAL_INVALID
            )
        username, password = credential.username.strip(), credential.password.rstrip("\r\n")
        if not username or not password:
            raise TokensvcError(
                "database credential has an empty username or password", reason=Reason.CREDENTIAL_INVALID
            )
        return DatabaseCredential(username, password)

    def stamp(self) -> tuple[int, ...]:
        return (self._current[0],)

    def write(self, credential: DatabaseCredential) -> None:
        self._current = (next(self._writes), credential)
