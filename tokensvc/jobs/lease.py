"""The lease a runner holds on one claimed job while it works on it."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Generic, TypeVar

from tokensvc.errors import TokensvcError
from tokensvc.jobs.store import LeasedJob, LeasedJobStore

__all__ = ["Lease"]

_log = logging.getLogger(__name__)
_Job = TypeVar("_Job", bound=LeasedJob)


class Lease(Generic[_Job]):
    """`job`'s lease held by `runner`: renewed every third of it while the work goes on
    (`keep`), and `lost` once the store refuses a renewal (taken over, cancelled, finished).

    A loss stops the work where the work asks (`while_held`, `lost`), never at an arbitrary
    await: the job's own last step (a pause, a finish) ends its lease too, and what follows it
    (the audit record) must not be cut off. The store refuses a lost runner's writes anyway.
    """

    def __init__(self, store: LeasedJobStore[_Job], job: _Job, runner: str, *, seconds: float):
        self._store = store
        self._job = job
        self._runner = runner
        self.seconds = seconds
        self._lost = asyncio.Event()

    @property
    def lost(self) -> bool:
        return self._lost.is_set()

    async def renew(self) -> bool:
        """Extend the lease now; False (and `lost` from then on) when the store refuses."""
        if await self._store.renew(self._job, self._runner, lease_seconds=self.seconds):
            return True
        self._lost.set()
        return False

    async def keep(self) -> None:
        """Renew every third of the lease until it is lost (or this task is cancelled). A step
        is leased from its read to its write: one that outlasts the lease (a slow embedder, a
        busy machine) would otherwise find it lapsed at every write and never make progress. A
        renewal that fails (the database is away) is tried again: the next write will tell."""
        while True:
            await asyncio.sleep(self.seconds / 3)
            try:
                if not await self.renew():
                    return
            except TokensvcError as exc:
                _log.warning("job %s: the lease was not renewed (%s)", self._job.id, exc.reason)
            except Exception:
                _log.exception("job %s: the lease was not renewed", self._job.id)

    async def while_held(self, task: asyncio.Task[Any]) -> bool:
        """Wait for `task` to finish while the lease is held: True when it did (its result or
        error in the task), False when the lease was lost first (`task` is cancelled: nobody
        would be allowed to write what it makes)."""
        if not self.lost:
            lost = asyncio.create_task(self._lost.wait())
            try:
                await asyncio.wait({task, lost}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                lost.cancel()
        if task.done():
            return True
        task.cancel()
        return False
