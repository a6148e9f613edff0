"""Database credential custody: zero-downtime RELOAD and ROTATE, journaled, crash-recoverable.

The pool asks `credential_for_new_connection()` for every new connection. It re-reads the secret
source each time, but only a credential that passed a real login test is ever used: a changed
file wakes the watcher, which reloads (tests, then switches); until then connections keep the
last good credential, so a bad file never breaks serving.

ROTATE follows AWS Secrets Manager's alternating users: two login roles share one group role's
grants; the inactive one gets a fresh password (sent as a SCRAM verifier) from a separate rotator
credential, its login is tested, the secret source is rewritten atomically, the pool switches and
retires old connections as they are released, and the old role's password is removed. Every
step is journaled before it is taken (`CredentialJournal`); `recover()` at start finishes or
undoes a rotation a crash interrupted, so the service comes back on exactly one working credential.

No SQL here: the custodian takes the ports of `tokensvc.storage.ports` (`CredentialSource`,
`CredentialJournal`, `DatabaseLogins`, `ConnectionPool`); PostgreSQL's side, including the
advisory lock that serialises rotations across replicas, is `tokensvc.storage.postgres`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime

from tokensvc.audit import SYSTEM_ACTOR, AuditKind, AuditLog, AuditOutcome
from tokensvc.errors import DatabaseRefused, Reason, TokensvcError
from tokensvc.names import is_sql_identifier
from tokensvc.observability.metrics import METRICS
from tokensvc.storage.ports import ConnectionPool, CredentialJournal, CredentialSource, DatabaseLogins
from tokensvc.storage.records import DatabaseCredential, RotationEntry
from tokensvc.storage.secrets import generate_password

__all__ = ["CredentialCustodian", "CredentialStatus", "RotationMode"]

_log = logging.getLogger(__name__)

RotationMode = str  # "reload" | "rotate"


@dataclass(frozen=True)
class CredentialStatus:
    active_role: str
    version: int
    last_rotated_at: datetime | None
    pool_size: int
    pool_in_use: int
    last_mode: str | None
    last_outcome: str | None


def _rotation_failed(message: str) -> TokensvcError:
    return TokensvcError(message, reason=Reason.ROTATION_FAILED)


class CredentialCustodian:
    def __init__(
        self,
        *,
        source: CredentialSource,
        rotator: CredentialSource | None,
        login_roles: tuple[str, str],
        logins: DatabaseLogins,
        audit: AuditLog | None = None,
        subject: str = "database credential",
    ):
        """`subject` names the credential in audit events and logs (the serving pool's is
        "database credential"; the re-embedding runner's has a custodian of its own)."""
        for role in login_roles:
            if not is_sql_identifier(role):
                raise ValueError(f"login role {role!r} is not a plain SQL identifier")
        self._source = source
        self._rotator = rotator
        self._roles = login_roles
        self._logins = logins
        self._active = source.read()
        self._stamp = source.stamp()
        self._changed = asyncio.Event()
        self._local_lock = asyncio.Lock()
        self._reloading = False
        self._pool: ConnectionPool | None = None
        self._journal: CredentialJournal | None = None
        self._audit = audit
        self._subject = subject

    def attach(self, pool: ConnectionPool, journal: CredentialJournal, audit: AuditLog) -> None:
        self._pool, self._journal, self._audit = pool, journal, audit

    @property
    def active_role(self) -> str:
        return self._active.username

    def credential_for_new_connection(self) -> DatabaseCredential:
        """The last tested credential; a changed secret source only wakes the watcher."""
        try:
            current = self._source.read()
        except TokensvcError:
            return self._active
        if current != self._active:
            self._changed.set()
        return self._active

    # --- the two modes ----------------------------------------------------------------------

    async def reload(self, actor: str) -> int | None:
        """Adopt the credential an external rotator put in the secret source, after testing it."""
        async with self._exclusive(AuditKind.CREDENTIAL_RELOAD, actor):
            try:
                new = self._source.read()
            except TokensvcError as exc:
                raise await self._refuse(AuditKind.CREDENTIAL_RELOAD, actor, exc) from None
            self._stamp = self._source.stamp()
            if new == self._active:
                return None
            journal = self._require_journal()
            rotation = await journal.begin(
                mode="reload", actor=actor, from_role=self._active.username, to_role=new.username
            )
            try:
                await journal.step(rotation, "test_login")
                await self._test_login(new)
            except TokensvcError as exc:
                await self._fail(rotation, AuditKind.CREDENTIAL_RELOAD, actor, exc)
                raise
            await journal.step(rotation, "switch")
            await self._switch(new)
            version = await journal.close(rotation, outcome="succeeded", step="completed")
            METRICS.rotations.labels("reload", "succeeded").inc()
            await self._record(
                AuditKind.CREDENTIAL_RELOAD,
                actor,
                f"reload {self._subject}",
                new.username,
                AuditOutcome.SUCCEEDED,
            )
            _log.info("%s reloaded", self._subject, extra={"role": new.username, "version": version})
            return version

    async def rotate(self, actor: str) -> int | None:
        """Rotate to the inactive login role with a fresh password (alternating users)."""
        kind = AuditKind.CREDENTIAL_ROTATION
        if self._rotator is None:
            missing = _rotation_failed(
                "ROTATE needs a rotator credential (setting database_rotator_credential_dir)"
            )
            raise await self._refuse(kind, actor, missing)
        async with self._exclusive(kind, actor):
            current = self._active
            if current.username not in self._roles:
                foreign = _rotation_failed(
                    f"the active role {current.username!r} is not one of the alternating login roles {self._roles}"
                )
                raise await self._refuse(kind, actor, foreign)
            inactive = self._roles[1] if current.username == self._roles[0] else self._roles[0]
            new = DatabaseCredential(inactive, generate_password())
            journal = self._require_journal()
            rotation = await journal.begin(
                mode="rotate", actor=actor, from_role=current.username, to_role=inactive
            )
            await self._record(
                AuditKind.CREDENTIAL_ROTATION,
                actor,
                f"rotate {self._subject}",
                inactive,
                AuditOutcome.STARTED,
            )
            try:
                await journal.step(rotation, "set_password")
                await self._alter_password(inactive, new.password)
                await journal.step(rotation, "test_login")
                await self._test_login(new)
                await journal.step(rotation, "write_secret")
                self._source.write(new)
                self._stamp = self._source.stamp()
            except (OSError, DatabaseRefused) as exc:
                kind_name = exc.kind if isinstance(exc, DatabaseRefused) else type(exc).__name__
                failure = _rotation_failed(
                    f"rotation failed before the switch ({kind_name}); still on {current.username}"
                )
                await self._fail(rotation, AuditKind.CREDENTIAL_ROTATION, actor, failure)
                raise failure from None
            except TokensvcError as exc:
                await self._fail(rotation, AuditKind.CREDENTIAL_ROTATION, actor, exc)
                raise
            # From here on the new credential is in the secret source: only forward.
            await journal.step(rotation, "switch")
            await self._switch(new)
            await journal.step(rotation, "retire_old")
            reason = ""
            try:
                await self._alter_password(current.username, None)
            except TokensvcError as exc:
                kind_name = exc.kind if isinstance(exc, DatabaseRefused) else type(exc).__name__
                reason = f"old role {current.username} not retired ({kind_name}); retry the rotation"
                _log.warning("old login role not retired", extra={"role": current.username})
            version = await journal.close(rotation, outcome="succeeded", step="completed", reason=reason)
            METRICS.rotations.labels("rotate", "succeeded").inc()
            await self._record(
                AuditKind.CREDENTIAL_ROTATION,
                actor,
                f"rotate {self._subject}",
                inactive,
                AuditOutcome.SUCCEEDED,
                detail=reason,
            )
            _log.info("%s rotated", self._subject, extra={"role": inactive, "version": version})
            return version

    # --- recovery and watching --------------------------------------------------------------

    async def recover(self) -> list[RotationEntry]:
        """Finish or undo rotations a crash interrupted; returns what was recovered."""
        journal = self._require_journal()
        open_rotations = await journal.open_rotations()
        if not open_rotations:
            return []
        try:
            async with self._exclusive():
                open_rotations = await journal.open_rotations()  # another replica may have recovered them
                for entry in open_rotations:
                    await self._recover_one(entry)
        except TokensvcError as exc:
            if exc.reason is Reason.ROTATION_IN_PROGRESS:
                return []  # a live replica is rotating right now; it is not a crash
            raise
        return open_rotations

    async def _recover_one(self, entry: RotationEntry) -> None:
        journal = self._require_journal()
        in_source = self._source.read()
        forward = in_source.username == entry.to_role and entry.to_role != entry.from_role
        if forward:
            await self._test_login(in_source)
            self._active = in_source
            if entry.mode == "rotate" and self._rotator is not None:
                with contextlib.suppress(TokensvcError):
                    await self._alter_password(entry.from_role, None)
            await journal.close(entry.id, outcome="recovered", reason=f"rolled forward to {entry.to_role}")
        else:
            # The secret source still holds the old credential, which was never retired.
            if entry.mode == "rotate" and self._rotator is not None and entry.to_role != in_source.username:
                with contextlib.suppress(TokensvcError):
                    await self._alter_password(entry.to_role, None)
            await journal.close(
                entry.id,
                outcome="recovered",
                reason=f"rolled back to {in_source.username}",
                keep_version=True,
            )
        await self._record(
            AuditKind.CREDENTIAL_ROTATION if entry.mode == "rotate" else AuditKind.CREDENTIAL_RELOAD,
            SYSTEM_ACTOR,
            "recover interrupted rotation",
            in_source.username,
            AuditOutcome.SUCCEEDED,
            detail=f"rotation {entry.id} interrupted at step {entry.step}; {'forward' if forward else 'back'}",
        )

    async def watch(self, interval: float) -> None:
        """Reload by itself when the secret source changes on disk (an external rotator)."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=interval)
            self._changed.clear()
            stamp = self._source.stamp()
            if stamp == self._stamp:
                continue
            try:
                await self.reload(SYSTEM_ACTOR)
            except TokensvcError as exc:
                if exc.reason is not Reason.ROTATION_IN_PROGRESS:
                    self._stamp = stamp  # report a bad file once, not every tick
                    _log.error(
                        "credential reload from the secret source failed; still on the previous credential",
                        extra={"reason": exc.reason.value, "credential": self._subject},
                    )
            except Exception as exc:
                _log.warning("credential watch failed", extra={"error": type(exc).__name__})

    async def status(self) -> CredentialStatus:
        journal = self._require_journal()
        # The journal first, in one snapshot, then the active role: a rotation closes its journal
        # row only after switching, so a closed row is never reported with the old role.
        version, rotated_at, latest = await journal.snapshot()
        active_role = self._active.username
        pool = self._pool
        size = pool.get_size() if pool is not None else 0
        idle = pool.get_idle_size() if pool is not None else 0
        return CredentialStatus(
            active_role=active_role,
            version=version,
            last_rotated_at=rotated_at,
            pool_size=size,
            pool_in_use=size - idle,
            last_mode=latest.mode if latest else None,
            last_outcome=latest.outcome if latest else None,
        )

    # --- steps ------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _exclusive(
        self, kind: AuditKind | None = None, actor: str = SYSTEM_ACTOR
    ) -> AsyncIterator[None]:
        """One rotation at a time: in this process, and across replicas (advisory lock).

        With `kind`, a refusal (busy, database unreachable) is recorded as that kind's failure.
        """
        if self._local_lock.locked() and not (kind is AuditKind.CREDENTIAL_RELOAD and self._reloading):
            busy = TokensvcError(
                "a credential rotation is already running", reason=Reason.ROTATION_IN_PROGRESS
            )
            raise await self._refuse(kind, actor, busy)
        # A RELOAD that meets a reload in progress here (the file watcher's) waits for it and then
        # finds the credential already adopted, instead of failing.
        async with self._local_lock:
            self._reloading = kind is AuditKind.CREDENTIAL_RELOAD
            try:
                async with contextlib.AsyncExitStack() as session:
                    try:
                        held = await session.enter_async_context(self._logins.rotation_lock(self._active))
                    except TokensvcError as exc:
                        raise await self._refuse(kind, actor, exc) from None
                    if not held:
                        elsewhere = TokensvcError(
                            "a credential rotation is already running on another replica",
                            reason=Reason.ROTATION_IN_PROGRESS,
                        )
                        raise await self._refuse(kind, actor, elsewhere)
                    yield
            finally:
                self._reloading = False

    async def _test_login(self, credential: DatabaseCredential) -> None:
        await self._logins.test_login(credential)

    async def _alter_password(self, role: str, password: str | None) -> None:
        assert self._rotator is not None
        if not is_sql_identifier(role):
            raise _rotation_failed(f"role {role!r} is not a plain SQL identifier")
        await self._logins.set_password(role, password, admin=self._rotator.read())

    async def _switch(self, new: DatabaseCredential) -> None:
        self._active = new
        if self._pool is not None:
            # Idle connections close now, busy ones when released; new ones use `new`.
            await self._pool.expire_connections()

    async def _fail(self, rotation: int, kind: AuditKind, actor: str, exc: TokensvcError) -> None:
        METRICS.rotations.labels(
            "rotate" if kind is AuditKind.CREDENTIAL_ROTATION else "reload", "failed"
        ).inc()
        with contextlib.suppress(Exception):
            await self._require_journal().close(rotation, outcome="failed", reason=exc.reason.value)
        await self._record(
            kind,
            actor,
            f"{kind.value.replace('_', ' ')}",
            "",
            AuditOutcome.FAILED,
            reason=exc.reason,
            detail=exc.message,
        )
        _log.warning(
            "credential change failed; still on the previous credential",
            extra={"reason": exc.reason.value, "role": self._active.username, "credential": self._subject},
        )

    async def _refuse(self, kind: AuditKind | None, actor: str, exc: TokensvcError) -> TokensvcError:
        """Record a change refused before it was journaled; returns `exc` for the caller to raise.

        The watcher's own "already running" is not a failure: it retries on its next tick.
        """
        if kind is not None and not (actor == SYSTEM_ACTOR and exc.reason is Reason.ROTATION_IN_PROGRESS):
            action = kind.value.replace("_", " ")
            await self._record(
                kind, actor, action, "", AuditOutcome.FAILED, reason=exc.reason, detail=exc.message
            )
        return exc

    async def _record(
        self,
        kind: AuditKind,
        actor: str,
        action: str,
        target: str,
        outcome: AuditOutcome,
        *,
        reason: Reason | None = None,
        detail: str = "",
    ) -> None:
        if self._audit is not None:
            await self._audit.record(
                kind, actor=actor, action=action, target=target, outcome=outcome, reason=reason, detail=detail
            )

    def _require_journal(self) -> CredentialJournal:
        if self._journal is None:
            raise RuntimeError("CredentialCustodian.attach() has not run")
        return self._journal
