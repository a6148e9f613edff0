"""The job runner on its own (`tokensvc.jobs`), with a tiny kind of job over an in-process store:
real asyncio, no database. What it pins: leases are renewed while a step outlasts them, a lost
lease stops the work, failures back off doubling up to the cap and pause a job after
`pause_after`, a runner works on at most `parallel` jobs at once and on a job in one turn at most
(its lease is the runner's: two turns would both pass it), a wake-up starts work at once.

Each wait below loops until the state it waits for is reached; nothing asserts a duration.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

import pytest

from tokensvc.jobs import JobRunner, JobSettings, JobTurn, Throughput

STEPS = 3


@dataclass(frozen=True)
class TinyJob:
    """A job of `STEPS` steps; its progress is the steps done."""

    id: str
    failures: int = 0
    paused: bool = False
    done: int = 0


class TinyStore:
    """Leases with expiry on the event loop's clock; every write fenced by the lease."""

    def __init__(self, *ids: str):
        self.jobs = {job_id: TinyJob(job_id) for job_id in ids}
        self.leases: dict[str, tuple[str, float]] = {}  # id -> (owner, until)
        self.renewals = 0
        # When set, a claim waits for it (after choosing its job): a claim in flight.
        self.claim_gate: asyncio.Event | None = None

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def holds(self, job_id: str, runner: str) -> bool:
        owner, until = self.leases.get(job_id, ("", 0.0))
        return owner == runner and until >= self._now()

    async def claim(self, runner: str, *, lease_seconds: float, busy: Collection[str]) -> TinyJob | None:
        for job in self.jobs.values():
            owner, until = self.leases.get(job.id, (None, 0.0))
            free = owner in (None, runner) or until < self._now()
            if free and job.id not in busy and not job.paused and job.done < STEPS:
                self.leases[job.id] = (runner, self._now() + lease_seconds)
                if self.claim_gate is not None:
                    await self.claim_gate.wait()
                return job
        return None

    async def renew(self, job: TinyJob, runner: str, *, lease_seconds: float) -> bool:
        owner, _ = self.leases.get(job.id, ("", 0.0))
        stored = self.jobs[job.id]
        if owner != runner or stored.paused or stored.done >= STEPS:
            return False
        self.renewals += 1
        self.leases[job.id] = (runner, self._now() + lease_seconds)
        return True

    async def record_failure(
        self, job: TinyJob, runner: str, reason: str, *, pause_after: int
    ) -> TinyJob | None:
        if not self.holds(job.id, runner):
            return None
        failures = self.jobs[job.id].failures + 1
        self.jobs[job.id] = replace(self.jobs[job.id], failures=failures, paused=failures >= pause_after)
        if failures >= pause_after:
            del self.leases[job.id]
        return self.jobs[job.id]

    async def write_step(self, job: TinyJob, runner: str) -> bool:
        """A step's write and its progress, refused without the lease."""
        if not self.holds(job.id, runner):
            return False
        stored = self.jobs[job.id]
        self.jobs[job.id] = replace(stored, done=stored.done + 1, failures=0)
        return True

    def take_over(self, job_id: str, runner: str) -> None:
        """Another runner claims the job (its lease expired meanwhile)."""
        self.leases[job_id] = (runner, self._now() + 60)


class TinyKind:
    """Works on a job step by step. `gate` (when set) holds every step until it is opened;
    `failing` makes every step fail."""

    name = "tiny job"

    def __init__(self, store: TinyStore):
        self.store = store
        self.gate: asyncio.Event | None = None
        self.failing = False
        self.working: set[str] = set()
        self.most_at_once = 0
        self.turns: dict[str, int] = {}  # turns under way per job
        self.most_turns_on_one_job = 0
        self.cancelled_steps = 0
        self.paused_jobs: list[tuple[str, str]] = []

    async def _step(self) -> None:
        try:
            if self.gate is not None:
                await self.gate.wait()
            if self.failing:
                raise RuntimeError("the service answered 503")
        except asyncio.CancelledError:
            self.cancelled_steps += 1
            raise

    async def work(self, job: TinyJob, turn: JobTurn[TinyJob]) -> None:
        self.working.add(job.id)
        self.most_at_once = max(self.most_at_once, len(self.working))
        self.turns[job.id] = self.turns.get(job.id, 0) + 1
        self.most_turns_on_one_job = max(self.most_turns_on_one_job, self.turns[job.id])
        try:
            while self.store.jobs[job.id].done < STEPS and not turn.lease.lost:
                step = asyncio.create_task(self._step())
                if not await turn.lease.while_held(step):
                    return
                if step.exception() is not None:
                    if not await turn.failed(job, str(step.exception())):
                        return
                    continue
                if not await self.store.write_step(job, turn.runner_id):
                    return
        finally:
            self.working.discard(job.id)
            self.turns[job.id] -= 1

    async def paused(self, job: TinyJob, reason: str) -> None:
        self.paused_jobs.append((job.id, reason))


async def until(condition: object, *, tries: int = 2000) -> None:
    """Yield to the loop until `condition()` holds (a bounded number of short sleeps)."""
    for _ in range(tries):
        if condition():  # type: ignore[operator]
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the condition was never reached")


@contextlib.asynccontextmanager
async def running(runner: JobRunner[TinyJob]) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(runner.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def runner_of(kind: TinyKind, store: TinyStore, settings: JobSettings) -> JobRunner[TinyJob]:
    return JobRunner(kind, store, settings, runner_id="runner-a")


async def test_a_step_slower_than_the_lease_keeps_it_renewed_and_writes() -> None:
    store = TinyStore("job-1")
    kind = TinyKind(store)
    kind.gate = asyncio.Event()
    runner = runner_of(kind, store, JobSettings(lease_seconds=0.3))
    stepping = asyncio.create_task(runner.step())
    # Several lease lengths pass while the first step is held; the lease stays this runner's.
    await until(lambda: store.renewals >= 4, tries=20_000)
    assert store.holds("job-1", "runner-a")
    kind.gate.set()
    assert await stepping
    assert store.jobs["job-1"].done == STEPS  # every step's write was accepted under the lease


async def test_a_lost_lease_stops_the_work_and_cancels_the_step_under_way() -> None:
    store = TinyStore("job-1")
    kind = TinyKind(store)
    kind.gate = asyncio.Event()  # never opened: the step would wait forever
    runner = runner_of(kind, store, JobSettings(lease_seconds=0.06))
    stepping = asyncio.create_task(runner.step())
    await until(lambda: "job-1" in kind.working)
    store.take_over("job-1", "runner-b")  # the next renewal is refused
    assert await stepping  # the turn ended: the work stopped on its own
    assert kind.cancelled_steps == 1
    assert store.jobs["job-1"].done == 0
    assert store.leases["job-1"][0] == "runner-b"


def test_the_backoff_doubles_from_the_first_wait_up_to_the_cap() -> None:
    settings = JobSettings(backoff_seconds=0.5, max_backoff_seconds=3.0)
    assert [settings.backoff(failures) for failures in range(1, 7)] == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]


async def test_failures_back_off_doubling_to_the_cap_then_the_job_pauses_and_is_not_claimed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = TinyStore("job-1")
    kind = TinyKind(store)
    kind.failing = True
    runner = runner_of(
        kind, store, JobSettings(pause_after=5, backoff_seconds=0.001, max_backoff_seconds=0.004)
    )
    with caplog.at_level(logging.WARNING, logger="tokensvc.jobs.runner"):
        assert await runner.step()
    waits = [record.args[-1] for record in caplog.records if "retrying in" in record.msg]  # type: ignore[index]
    assert waits == [0.001, 0.002, 0.004, 0.004]  # after failures 1-4; the fifth pauses
    assert store.jobs["job-1"] == TinyJob("job-1", failures=5, paused=True)
    assert kind.paused_jobs == [("job-1", "the service answered 503")]
    assert "job-1" not in store.leases  # the pause released the lease
    assert not await runner.step()  # a paused job is not claimed


async def test_a_success_between_failures_starts_the_count_again() -> None:
    store = TinyStore("job-1")
    kind = TinyKind(store)
    runner = runner_of(kind, store, JobSettings(pause_after=2, backoff_seconds=0.001))
    original = kind._step
    calls = 0

    async def every_other_step_fails() -> None:
        nonlocal calls
        calls += 1
        if calls % 2:
            raise RuntimeError("flaky")
        await original()

    kind._step = every_other_step_fails  # type: ignore[method-assign]
    assert await runner.step()
    assert store.jobs["job-1"] == TinyJob("job-1", failures=0, paused=False, done=STEPS)
    assert kind.paused_jobs == []


async def test_a_runner_works_on_at_most_parallel_jobs_and_takes_the_next_when_one_ends() -> None:
    store = TinyStore("job-1", "job-2", "job-3", "job-4")
    kind = TinyKind(store)
    kind.gate = asyncio.Event()
    runner = runner_of(kind, store, JobSettings(parallel=2, poll_seconds=0.01))
    async with running(runner):
        await until(lambda: len(kind.working) == 2)
        for _ in range(20):  # polls come and go: no third job is taken
            await asyncio.sleep(0.01)
            assert len(kind.working) == 2
        assert {job.id for job in store.jobs.values() if job.done} == set()
        kind.gate.set()
        await until(lambda: all(job.done == STEPS for job in store.jobs.values()))
    assert kind.most_at_once == 2


async def test_a_wake_up_starts_a_new_job_without_waiting_for_the_poll() -> None:
    store = TinyStore()
    kind = TinyKind(store)
    runner = runner_of(kind, store, JobSettings(poll_seconds=3600))
    async with running(runner):
        await asyncio.sleep(0.01)  # the runner found nothing and waits for its (hour-long) poll
        store.jobs["job-1"] = TinyJob("job-1")
        runner.wake()
        await until(lambda: store.jobs["job-1"].done == STEPS)


def test_throughput_is_the_rate_so_far_and_the_time_left_at_it() -> None:
    start = datetime(2026, 1, 1)
    moving = Throughput.of(done=30, total=90, started=start, last=start + timedelta(seconds=10), running=True)
    assert moving == Throughput(3.0, 20.0)
    stopped = Throughput.of(
        done=30, total=90, started=start, last=start + timedelta(seconds=10), running=False
    )
    assert stopped == Throughput(3.0, None)
    assert Throughput.of(done=0, total=90, started=start, last=start, running=True) == Throughput(0.0, None)


async def test_work_on_a_job_the_runners_own_claim_took_waits_for_that_work_and_starts_no_second() -> None:
    store = TinyStore("job-1")
    kind = TinyKind(store)
    kind.gate = asyncio.Event()
    runner = runner_of(kind, store, JobSettings())
    stepping = asyncio.create_task(runner.step())  # the runner's own claim takes the job
    await until(lambda: "job-1" in kind.working)
    # An upload that waits for its version asks the same runner to work on it (its lease is
    # this runner's, so a second turn would pass every lease check).
    waiting = asyncio.create_task(runner.work_on(store.jobs["job-1"]))
    for _ in range(20):
        await asyncio.sleep(0.005)
        assert not waiting.done()  # it waits for the work under way
    kind.gate.set()
    await waiting
    assert await stepping
    assert store.jobs["job-1"].done == STEPS
    assert kind.most_turns_on_one_job == 1


async def test_a_claim_that_comes_back_with_a_job_work_on_took_meanwhile_starts_no_second_turn() -> None:
    store = TinyStore("job-1")
    store.claim_gate = asyncio.Event()
    kind = TinyKind(store)
    kind.gate = asyncio.Event()
    runner = runner_of(kind, store, JobSettings())
    stepping = asyncio.create_task(runner.step())  # its claim has chosen job-1 and is in flight
    await until(lambda: "job-1" in store.leases)
    waiting = asyncio.create_task(runner.work_on(store.jobs["job-1"]))
    await until(lambda: "job-1" in kind.working)
    store.claim_gate.set()
    assert not await stepping  # the claim's job is worked on already: dropped
    kind.gate.set()
    await waiting
    assert store.jobs["job-1"].done == STEPS
    assert kind.most_turns_on_one_job == 1
