"""The one runner of background work: claims up to `parallel` jobs of a kind, holds their leases
while the kind works on them, backs off after a failure and pauses a job after too many in a row.

A kind of job (re-embedding today, background ingestion next) brings its store
(`LeasedJobStore`) and its work (`JobKind`); what a job's steps are, and how each one writes its
progress under the lease, is the kind's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from tokensvc.errors import TokensvcError
from tokensvc.jobs.lease import Lease
from tokensvc.jobs.store import LeasedJob, LeasedJobStore

__all__ = ["JobKind", "JobRunner", "JobSettings", "JobTurn"]

_log = logging.getLogger(__name__)
_Job = TypeVar("_Job", bound=LeasedJob)
_Result = TypeVar("_Result")


@dataclass(frozen=True)
class JobSettings:
    lease_seconds: float = 30.0
    # Consecutive failures before a job pauses, and the first retry's wait (doubling up to the cap).
    pause_after: int = 5
    backoff_seconds: float = 1.0
    max_backoff_seconds: float = 60.0
    # How often an idle runner looks for work (a wake-up looks at once).
    poll_seconds: float = 2.0
    # Jobs one runner works on at once, each in a task of its own, so a slow one (a large
    # space on Citus, an embedder that keeps failing) does not hold the others back.
    parallel: int = 2

    def backoff(self, failures: int) -> float:
        """The wait before retrying a job that has failed `failures` times in a row."""
        return min(self.backoff_seconds * 2.0 ** (failures - 1), self.max_backoff_seconds)


class JobTurn(Generic[_Job]):
    """What a kind's work gets for one claimed job: the job's lease, and `failed`, the retry
    policy (count, back off, pause)."""

    def __init__(self, runner: JobRunner[_Job], lease: Lease[_Job]):
        self._runner = runner
        self.lease = lease

    @property
    def runner_id(self) -> str:
        return self._runner.runner_id

    async def failed(self, job: _Job, reason: str) -> bool:
        """Count a failure of `job` with `reason`: True after the backoff (retry the step),
        False when the job paused (the kind was told) or the lease is lost."""
        return await self._runner.failed(job, reason)


class JobKind(Protocol[_Job]):
    """One kind of background job: its work on a claimed job, and what it says when one pauses."""

    # The kind in logs ("embedding migration").
    name: str

    async def work(self, job: _Job, turn: JobTurn[_Job]) -> None:
        """Work on `job` until it is done, waits, pauses or the lease is lost (`turn.lease`);
        each write checks the lease in its own transaction. An exception is logged, and the job
        is not asked for again before `poll_seconds`."""
        ...

    async def paused(self, job: _Job, reason: str) -> None:
        """`job` has just paused after too many failures in a row (`reason`: the last one)."""
        ...


class JobRunner(Generic[_Job]):
    """Runs one kind's jobs in the background: claims up to `parallel`, works on each in a task
    of its own with its lease kept, claims again when one ends or at the next poll."""

    def __init__(
        self,
        kind: JobKind[_Job],
        store: LeasedJobStore[_Job],
        settings: JobSettings,
        *,
        runner_id: str,
    ):
        self._kind = kind
        self._store = store
        self._settings = settings
        self.runner_id = runner_id
        self._woken = asyncio.Event()
        # The jobs this runner works on now, each with the event set when that work ends. One
        # turn per job at most: two turns of one runner pass each other's lease checks (the
        # lease is the runner's), so their writes would interleave.
        self._working: dict[str, asyncio.Event] = {}

    def wake(self) -> None:
        """Look for work now instead of at the next poll (a job was started here)."""
        self._woken.set()

    async def run(self) -> None:
        """Forever: work on up to `parallel` jobs at once; when none is left to claim, wait
        `poll_seconds` (or a wake-up, or the end of a job's turn). Errors are logged."""
        turns: set[asyncio.Task[None]] = set()
        try:
            while True:
                claimed = None
                if len(turns) < self._settings.parallel:
                    claimed = await self._logged(self._claim())
                if claimed is not None:
                    turns.add(asyncio.create_task(self._turn(claimed)))
                    continue  # perhaps another one
                woken = asyncio.create_task(self._woken.wait())
                try:
                    await asyncio.wait(
                        {woken, *turns},
                        timeout=self._settings.poll_seconds,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                finally:
                    woken.cancel()
                self._woken.clear()
                turns = {task for task in turns if not task.done()}
        finally:
            for task in turns:
                task.cancel()
            await asyncio.gather(*turns, return_exceptions=True)

    async def step(self) -> bool:
        """Claim one job and work on it until it is done, waits or is lost; False: none."""
        job = await self._claim()
        if job is None:
            return False
        await self._work(job)
        return True

    async def work_on(self, job: _Job) -> None:
        """Work on a job this runner holds the lease of without `claim` (it was created leased
        to it, for a caller that waits), as a claimed one: its lease kept, its failures counted.
        When this runner works on it already (its own claim took it first), wait for that work
        to end instead."""
        running = self._working.get(job.id)
        if running is not None:
            await running.wait()
            return
        self._working[job.id] = asyncio.Event()
        await self._work(job)

    async def _turn(self, job: _Job) -> None:
        """Work on a claimed job; after a failure, hold its slot for `poll_seconds`, so a
        database or a service that is away is not asked again at once, in a loop."""
        if not await self._logged(self._work(job)):
            await asyncio.sleep(self._settings.poll_seconds)

    async def _logged(self, work: Awaitable[_Result]) -> _Result | None:
        """The result of `work`, or None when it failed (logged: the next turn tries again)."""
        try:
            return await work
        except asyncio.CancelledError:
            raise
        except TokensvcError as exc:  # the database or a service is away: try again later
            _log.warning("%s runner paused a turn (%s); retrying", self._kind.name, exc.reason)
        except Exception:
            _log.exception("%s runner failed; retrying", self._kind.name)
        return None

    async def _claim(self) -> _Job | None:
        """The next job to work on, not one this runner works on already; marked as worked on."""
        job = await self._store.claim(
            self.runner_id, lease_seconds=self._settings.lease_seconds, busy=frozenset(self._working)
        )
        if job is None or job.id in self._working:  # `work_on` took it while the claim ran
            return None
        self._working[job.id] = asyncio.Event()
        return job

    async def _work(self, job: _Job) -> bool:
        """The kind's work on a claimed job with its lease kept; True when it did not fail."""
        lease = Lease(self._store, job, self.runner_id, seconds=self._settings.lease_seconds)
        keeper = asyncio.create_task(lease.keep())
        try:
            await self._kind.work(job, JobTurn(self, lease))
        finally:
            keeper.cancel()
            self._working.pop(job.id).set()
        return True

    async def failed(self, job: _Job, reason: str) -> bool:
        """`JobTurn.failed`: record the failure; pause at `pause_after`, else back off."""
        counted = await self._store.record_failure(
            job, self.runner_id, reason, pause_after=self._settings.pause_after
        )
        if counted is None:
            return False
        if counted.paused:
            await self._kind.paused(counted, reason)
            return False
        wait = self._settings.backoff(counted.failures)
        _log.warning("%s %s: %s; retrying in %.1f s", self._kind.name, job.id, reason, wait)
        await asyncio.sleep(wait)
        return True
