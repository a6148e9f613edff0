"""The revocation list every replica holds in memory, kept current by announcements and polling.

Checking a capability against it costs two set look-ups on the request path. A revocation made
on this replica applies at once. One made anywhere else (another replica, an operator's INSERT)
is announced by PostgreSQL when its transaction commits (`RevocationStore.listen`: LISTEN/NOTIFY,
migration 0012). An announcement is only a hint: any database role can send one, so the list
reads the row it names (`RevocationStore.find`, one query) and applies what the table holds,
milliseconds after the commit; an announcement with no row behind it changes nothing.
When the announcements' connection is down (it is re-opened at every full resync), polling
carries it: every poll asks for the rows revoked since the previous poll's read, by the
database's clock (`RevocationSnapshot.as_of`, never a row's `revoked_at`, which an operator or a
forger may set anywhere), minus an overlap of 30 s, so a row committed up to 30 s after its
`revoked_at` is still seen.

A row can become visible later than that: a commit held up by synchronous replication or an I/O
stall, a restored backup, a row an operator inserted with an old time. `revoked_at` is the insert
time, not the commit time, so no window on it is safe. Every `full_sync_seconds` (10 s) the poll
therefore reads every revocation (they are few: a row per revoked token or run), which bounds the
worst case without announcements: a revocation applies on every replica at most
`full_sync_seconds + poll_seconds` after its commit becomes visible. (Announcements do not cover
a restored backup; the resync does.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta

from tokensvc.storage.ports import RevocationFeed, RevocationStore
from tokensvc.storage.records import Revocation, RevocationKind, RevocationSnapshot

__all__ = ["FULL_SYNC_SECONDS", "RevocationList"]

_log = logging.getLogger(__name__)
_OVERLAP = timedelta(seconds=30)
FULL_SYNC_SECONDS = 10.0
# Announced keys waiting to be read back. A flood past this (forged, since real revocations are
# few) is dropped for one read of every row since the watermark.
_MAX_PENDING = 1024


class RevocationList:
    def __init__(
        self,
        store: RevocationStore,
        *,
        poll_seconds: float = 1.0,
        full_sync_seconds: float = FULL_SYNC_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._store = store
        self._poll_seconds = poll_seconds
        self._jtis: set[str] = set()
        self._runs: set[str] = set()
        self._watermark: datetime | None = None  # the database's clock at the last poll's read
        self._task: asyncio.Task[None] | None = None
        self._pending: set[tuple[RevocationKind, str]] = set()
        self._catch_up = False  # announcements overflowed: read every row since the watermark
        self._reader: asyncio.Task[None] | None = None
        self._feed: RevocationFeed | None = None
        self._listeners: list[Callable[[RevocationKind, str], None]] = []
        self._clock = clock
        self._last_sync = clock()
        self._full_sync_seconds = full_sync_seconds
        self._last_full_sync = clock()
        # Past this age the list may miss revocations made elsewhere: refuse rather than trust it.
        self.max_staleness = max(5.0, 3 * poll_seconds) + poll_seconds

    def on_revoked(self, listener: Callable[[RevocationKind, str], None]) -> None:
        """Call `listener(kind, value)` for every newly seen revocation (cache eviction)."""
        self._listeners.append(listener)

    def is_revoked(self, jti: str, run_id: str) -> bool:
        return jti in self._jtis or run_id in self._runs

    @property
    def age_seconds(self) -> float:
        """Seconds since the last successful sync."""
        return self._clock() - self._last_sync

    @property
    def is_current(self) -> bool:
        """Whether the last successful sync is recent enough to honour every replica's revocations."""
        return self.age_seconds <= self.max_staleness

    @property
    def is_listening(self) -> bool:
        """Whether revocations made elsewhere are announced to this list as they commit."""
        return self._feed is not None and self._feed.is_open

    async def start(self) -> None:
        await self._listen()  # first, so nothing committed between the load and the feed is missed
        self._load(await self._store.all())
        self._last_sync = self._last_full_sync = self._clock()
        self._task = asyncio.create_task(self._poll_forever(), name="revocation-poller")

    async def stop(self) -> None:
        for task in (self._task, self._reader):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._reader = None
        if self._feed is not None:
            await self._feed.close()
            self._feed = None

    async def _listen(self) -> None:
        try:
            self._feed = await self._store.listen(self._announced)
        except Exception as exc:
            self._feed = None
            _log.warning("revocation announcements unavailable; polling", extra={"error": type(exc).__name__})

    async def revoke(self, kind: RevocationKind, value: str, *, reason: str, revoked_by: str) -> datetime:
        revoked_at = await self._store.revoke(kind, value, reason=reason, revoked_by=revoked_by)
        self._apply([Revocation(kind, value, revoked_at)])
        return revoked_at

    async def poll_once(self) -> None:
        synced_at = self._clock()
        if self._watermark is None or synced_at - self._last_full_sync >= self._full_sync_seconds:
            if not self.is_listening:
                if self._feed is not None:
                    await self._feed.close()
                await self._listen()  # before the resync, which then covers the gap
            self._load(await self._store.all())
            self._last_full_sync = synced_at
        else:
            self._load(await self._store.since(self._watermark - _OVERLAP))
        self._last_sync = synced_at

    def _announced(self, kind: RevocationKind, value: str) -> None:
        """A hint that (kind, value) was revoked: honoured once its row is read back."""
        if len(self._pending) >= _MAX_PENDING:
            # A flood (forged: real revocations are few). Reading back every key would follow
            # the forger; one read of the rows since the watermark finds every real one instead,
            # the announced key among them.
            self._pending.clear()
            self._catch_up = True
        else:
            self._pending.add((kind, value))
        if self._reader is None or self._reader.done():
            self._reader = asyncio.create_task(self._read_announced(), name="revocation-announcements")

    async def _read_announced(self) -> None:
        # Keys announced while a read is under way wait for the next one: one query per batch.
        while self._pending or self._catch_up:
            try:
                if self._catch_up:
                    self._catch_up = False
                    self._pending.clear()
                    await self.poll_once()
                else:
                    keys, self._pending = self._pending, set()
                    self._apply(await self._store.find(keys))
            except Exception as exc:
                _log.warning(
                    "reading announced revocations failed; the poll finds them",
                    extra={"error": type(exc).__name__},
                )

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self._poll_seconds)
            try:
                await self.poll_once()
            except Exception as exc:
                _log.warning("revocation poll failed; retrying", extra={"error": type(exc).__name__})

    def _load(self, snapshot: RevocationSnapshot) -> None:
        self._apply(snapshot.revocations)
        self._watermark = snapshot.as_of

    def _apply(self, revocations: Iterable[Revocation]) -> None:
        for revocation in revocations:
            target = self._jtis if revocation.kind == "jti" else self._runs
            if revocation.value not in target:
                target.add(revocation.value)
                for listener in self._listeners:
                    listener(revocation.kind, revocation.value)
