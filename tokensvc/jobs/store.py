"""The port a kind of leased job implements: claim a job, hold its lease, count its failures.

Every call names the runner; a store answers nothing (None, False) for a runner that does not
hold the job's unexpired lease, so a runner that lost its job (a stall past the lease, a
takeover) can no longer change it. The kind's own writes (a batch and its progress) check the
same lease in the same transaction: the runner renews leases, the store fences every write.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol, TypeVar

__all__ = ["LeasedJob", "LeasedJobStore"]


class LeasedJob(Protocol):
    """What the runner reads of a job record (frozen dataclasses of each kind serve it)."""

    @property
    def id(self) -> str:
        """The job's stable id (what `busy` lists)."""
        ...

    @property
    def failures(self) -> int:
        """Its consecutive failures as stored (the backoff grows with them)."""
        ...

    @property
    def paused(self) -> bool:
        """It waits for an operator: too many failures in a row paused it."""
        ...


_Job = TypeVar("_Job", bound=LeasedJob)


class LeasedJobStore(Protocol[_Job]):
    """Claims, leases and failures of one kind of job, durable and shared by every replica."""

    async def claim(self, runner: str, *, lease_seconds: float, busy: Collection[str]) -> _Job | None:
        """Take the lease of the oldest runnable job whose lease is free, expired (the takeover
        of a runner that died or stalled) or `runner`'s own, other than those in `busy` (the
        ids `runner` works on already), for `lease_seconds`. None when there is none."""
        ...

    async def renew(self, job: _Job, runner: str, *, lease_seconds: float) -> bool:
        """Extend `runner`'s lease (an expired one too, when no runner has taken it since);
        False when another runner holds the job or it has no work for a runner any more."""
        ...

    async def record_failure(self, job: _Job, runner: str, reason: str, *, pause_after: int) -> _Job | None:
        """Count a consecutive failure with `reason`; at `pause_after` of them pause the job
        (releasing its lease). The job as stored; None when `runner` does not hold the lease."""
        ...
