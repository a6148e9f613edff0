"""Revocations and the audit trail in process memory (the contracts:
`tokensvc.storage.ports.RevocationStore` and `AuditStore`)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from datetime import datetime

from tokensvc.storage.inprocess.clock import Clock, StoreClock
from tokensvc.storage.records import AuditRecord, Revocation, RevocationKind, RevocationSnapshot

__all__ = ["InProcessAuditStore", "InProcessRevocationStore"]

_MAX_DETAIL = 2048


class InProcessRevocationStore:
    """`RevocationStore` over a dictionary; a revocation is visible (and its key announced to
    listeners) as soon as it is recorded. `announce` sends an announcement with no record behind
    it, as any PostgreSQL role can."""

    def __init__(self, clock: Clock | None = None):
        self._clock = StoreClock(clock)
        self._revocations: dict[tuple[RevocationKind, str], Revocation] = {}
        self._feeds: list[_Feed] = []

    async def revoke(self, kind: RevocationKind, value: str, *, reason: str, revoked_by: str) -> datetime:
        key = (kind, value)
        if key not in self._revocations:
            self._revocations[key] = Revocation(kind, value, self._clock.now())
            self.announce(kind, value)
        return self._revocations[key].revoked_at

    def announce(self, kind: RevocationKind, value: str) -> None:
        for feed in [f for f in self._feeds if f.is_open]:
            feed.announce(kind, value)

    async def listen(self, on_announced: Callable[[RevocationKind, str], None]) -> _Feed:
        feed = _Feed(on_announced)
        self._feeds.append(feed)
        return feed

    async def since(self, moment: datetime) -> RevocationSnapshot:
        as_of = self._clock.now()
        return RevocationSnapshot(
            tuple(r for r in self._revocations.values() if r.revoked_at >= moment), as_of
        )

    async def all(self) -> RevocationSnapshot:
        return RevocationSnapshot(tuple(self._revocations.values()), self._clock.now())

    async def find(self, keys: Collection[tuple[RevocationKind, str]]) -> list[Revocation]:
        return [self._revocations[key] for key in set(keys) if key in self._revocations]


class _Feed:
    def __init__(self, on_announced: Callable[[RevocationKind, str], None]):
        self.announce = on_announced
        self._open = True

    @property
    def is_open(self) -> bool:
        return self._open

    async def close(self) -> None:
        self._open = False


class InProcessAuditStore:
    """`AuditStore` over a list; ids start at 1 and increase by one."""

    def __init__(self, clock: Clock | None = None):
        self._clock = StoreClock(clock)
        self._events: list[AuditRecord] = []

    async def append(
        self, *, kind: str, actor: str, action: str, target: str, outcome: str, reason: str, detail: str
    ) -> int:
        event = AuditRecord(
            id=len(self._events) + 1,
            occurred_at=self._clock.now(),
            kind=kind,
            actor=actor,
            action=action,
            target=target,
            outcome=outcome,
            reason=reason,
            detail=detail[:_MAX_DETAIL],
        )
        self._events.append(event)
        return event.id

    async def page(
        self,
        *,
        before_id: int | None,
        kinds: Sequence[str],
        since: datetime | None,
        until: datetime | None,
        limit: int,
    ) -> list[AuditRecord]:
        wanted = set(kinds)
        found: list[AuditRecord] = []
        for event in reversed(self._events):
            if len(found) >= limit:
                break
            if (
                (before_id is None or event.id < before_id)
                and (not wanted or event.kind in wanted)
                and (since is None or event.occurred_at >= since)
                and (until is None or event.occurred_at < until)
            ):
                found.append(event)
        return found
