"""Background work as leased jobs in PostgreSQL: one runner for every kind (issue 36).

A kind of job brings its store (`LeasedJobStore`: claim, renew, record a failure) and its work
(`JobKind`); `JobRunner` claims up to `parallel` jobs, keeps each one's `Lease` while the kind
works on it, backs off after a failure (doubling up to a cap) and pauses a job after
`pause_after` failures in a row. A runner that dies or stalls loses its jobs when their leases
expire, and the next claim takes them over; every write of the kind checks the lease in its own
transaction, so a runner that lost a job can no longer change it. `Throughput` is a job's rate
and ETA from its progress.

Re-embedding (`tokensvc.reembedding`) is the first kind; background ingestion of knowledge
documents (issue 37) is the next. docs/architecture.md says why this is our own queue and not a
library's. This package knows no kind: it imports nothing of the domain (`tests/test_layering.py`).
"""

from __future__ import annotations

from tokensvc.jobs.lease import Lease
from tokensvc.jobs.progress import Throughput
from tokensvc.jobs.runner import JobKind, JobRunner, JobSettings, JobTurn
from tokensvc.jobs.store import LeasedJob, LeasedJobStore

__all__ = [
    "JobKind",
    "JobRunner",
    "JobSettings",
    "JobTurn",
    "Lease",
    "LeasedJob",
    "LeasedJobStore",
    "Throughput",
]
