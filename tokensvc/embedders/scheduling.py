"""Fair scheduling of embedder calls: queries first, then interactive writes, then bulk work, a fair
share per tenant within each class, and bounded queues.

Why. The embedding model is the one resource every tenant shares and the slowest step of a write
(a 256-word chunk costs the embedded model about 0.3 s). With one first-in-first-out queue, one
launcher's maximal Remember (256 texts of 32 KiB) held the model for minutes while another
tenant's one-line Remember waited out its deadline.

How. Each embedder has one `FairScheduler` that lets `slots` calls reach the model at once (the
embedded model's document threads, an endpoint's `concurrency`). A call is cut into slices of at
most one model batch (`Capacity`), and the slice is what is scheduled: when a slot frees, the next
slice comes from the first class with work (QUERY, INTERACTIVE, BULK) and, within it, by deficit
round-robin over the tenants' lanes. A lane is credited one quantum (the largest slice's cost, in
characters) each time its turn comes, so tenants share the model by characters embedded whatever
their batch sizes, and a small call waits for the slices already running plus at most one quantum
(one full slice's work) of each other tenant ahead of it in its class, never for the rest of a
large call.

The fast lane. A running slice cannot be interrupted, and one maximal passage takes the embedded
model seconds. So `fast_slots` more slots (the embedded model's fast thread, one more request to
an endpoint) take only short work: a query, or else an interactive slice of at most `fast_chars`
characters (a one-line Remember), in class and round-robin order. A search, and a short write,
then waits for at most one short slice, not for a long one.

Shares between classes. The classes are served in order, but while a later class has work
waiting, a class may hold at most all shared slots but one (with two or more; with one, queries,
which have the fast lane, leave it to the writes). So a flood of searches cannot stall every
Remember, nor a flood of Remembers every upload.

Bounded. A tenant's lane in a class holds at most `tenant_queue_texts` texts; a call that would go
past it is refused with `ConcurrencyLimit` (RESOURCE_EXHAUSTED) unless the lane is empty, so a call
that would succeed alone is never refused for its size.

A caller that goes away (deadline, cancellation) takes its queued slices with it; its slices
already running finish (a model batch cannot be interrupted) and free their slot then. One event
loop drives a scheduler (the server's): its state is only touched from that loop.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from tokensvc.errors import ConcurrencyLimit
from tokensvc.observability import METRICS

__all__ = ["Capacity", "Demand", "FairScheduler", "WorkClass", "capacity_of", "fair_share", "slice_ranges"]

_R = TypeVar("_R")


class WorkClass(enum.IntEnum):
    """Who waits for an embedding; a lower value is served first."""

    QUERY = 0  # a search: a caller waits, and for one short text
    INTERACTIVE = 1  # Remember, Update: a caller waits for its own writes
    BULK = 2  # document uploads, re-embedding migrations, background ingestion

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class Demand:
    """An embedding's class and the tenant whose fair share it uses."""

    work: WorkClass
    tenant: str

    @classmethod
    def of(cls, work: WorkClass, namespace: str, agent: str = "") -> Demand:
        return cls(work, fair_share(namespace, agent))


def fair_share(namespace: str, agent: str = "") -> str:
    """Whose share an embedding uses: an agent's (`namespace/agent`) or, with no agent (uploads,
    re-embedding), the namespace's."""
    return f"{namespace}/{agent}" if agent else namespace


@dataclass(frozen=True)
class Capacity:
    """How much of an embedder one scheduler hands out: `slots` calls at once, each a slice of at
    most `slice_texts` texts and `slice_chars` characters (unless one text alone is longer), plus
    `fast_slots` for short work only (a query, or an interactive slice of at most `fast_chars`);
    a text costs its length up to `text_chars` (what the embedder reads of it at most)."""

    slots: int = 1
    slice_texts: int = 64
    slice_chars: int = 1 << 20
    text_chars: int = 1 << 16
    fast_slots: int = 0
    fast_chars: int = 2048
    # What one slice costs besides its characters (a model call's fixed work), so that a tenant's
    # many one-line calls do not all go before another tenant's one.
    slice_overhead: int = 256

    def __post_init__(self) -> None:
        if min(self.slots, self.slice_texts, self.slice_chars, self.text_chars, self.fast_chars) < 1:
            raise ValueError("slots, slice sizes and fast_chars must be at least 1")
        if self.fast_slots < 0 or self.slice_overhead < 0:
            raise ValueError("fast_slots and slice_overhead must be at least 0")

    @property
    def quantum(self) -> int:
        """A lane's credit per turn: enough for the largest slice, so every turn serves one."""
        return max(self.slice_chars, self.text_chars) + self.slice_overhead


def capacity_of(embedder: object) -> Capacity:
    """The embedder's own `capacity` when it declares one, else one slot of default slices."""
    capacity = getattr(embedder, "capacity", None)
    return capacity if isinstance(capacity, Capacity) else Capacity()


def slice_ranges(costs: Sequence[int], size: int, chars: int) -> list[range]:
    """Consecutive index ranges of at most `size` items and (unless one item alone costs more)
    `chars` of cost, in order."""
    out: list[range] = []
    start = used = 0
    for index, cost in enumerate(costs):
        if index > start and (index - start == size or used + cost > chars):
            out.append(range(start, index))
            start, used = index, 0
        used += cost
    if start < len(costs):
        out.append(range(start, len(costs)))
    return out


@dataclass(eq=False)
class _Call(Generic[_R]):
    """One caller's texts: its slices not yet handed out, and the results of those that ran."""

    demand: Demand
    texts: list[str]
    embed: Callable[[list[str]], Awaitable[_R]]
    embed_fast: Callable[[list[str]], Awaitable[_R]]  # the same, on the embedder's fast lane
    pending: deque[tuple[int, range, int]]  # (slice number, text range, cost)
    done: asyncio.Future[None]
    results: list[_R | None]
    queued_texts: int
    unfinished: int
    admitted: float = field(default_factory=time.perf_counter)
    first_dispatch: bool = True


@dataclass(eq=False)
class _Lane:
    """One tenant's calls in one class, first come first served, and its round-robin credit."""

    tenant: str
    calls: deque[_Call[object]] = field(default_factory=deque)
    queued_texts: int = 0
    deficit: int = 0
    credited: bool = False


class FairScheduler:
    """Slices of embedder calls dispatched to `capacity.slots` slots; see the module docstring."""

    def __init__(self, embedder: str, capacity: Capacity, *, tenant_queue_texts: int) -> None:
        if tenant_queue_texts < 1:
            raise ValueError("tenant_queue_texts must be at least 1")
        self._embedder = embedder
        self._capacity = capacity
        self._bound = tenant_queue_texts
        self._free = capacity.slots
        self._free_fast = capacity.fast_slots
        self._held: dict[WorkClass, int] = dict.fromkeys(WorkClass, 0)  # shared slots per class
        self._lanes: dict[tuple[WorkClass, str], _Lane] = {}
        self._rings: dict[WorkClass, deque[_Lane]] = {work: deque() for work in WorkClass}
        self._running: set[asyncio.Task[None]] = set()

    def __repr__(self) -> str:
        return f"FairScheduler({self._embedder!r}, slots={self._capacity.slots})"

    @property
    def capacity(self) -> Capacity:
        return self._capacity

    def queued_texts(self, work: WorkClass, tenant: str | None = None) -> int:
        """Texts waiting (not yet handed to the model) in a class, of one tenant or all."""
        return sum(
            lane.queued_texts for (w, t), lane in self._lanes.items() if w is work and tenant in (None, t)
        )

    async def run(
        self,
        demand: Demand,
        texts: Sequence[str],
        embed: Callable[[list[str]], Awaitable[_R]],
        embed_fast: Callable[[list[str]], Awaitable[_R]] | None = None,
    ) -> list[_R]:
        """`embed` applied to each slice of `texts` when the schedule reaches it (`embed_fast`
        instead for a slice given a fast slot, when the embedder runs those elsewhere); the results
        in slice order. Raises `ConcurrencyLimit` when the tenant's lane is full, or what `embed`
        raised (the call's other slices are then dropped)."""
        texts = list(texts)
        capacity = self._capacity
        costs = [max(1, min(len(text), capacity.text_chars)) for text in texts]
        ranges = slice_ranges(costs, capacity.slice_texts, capacity.slice_chars)
        key = (demand.work, demand.tenant)
        lane = self._lanes.get(key)
        if lane is not None and lane.queued_texts and lane.queued_texts + len(texts) > self._bound:
            METRICS.embed_refused.labels(self._embedder, demand.work.label).inc()
            raise ConcurrencyLimit(
                f"this tenant already has {lane.queued_texts} texts waiting for the embedder "
                f"(at most {self._bound}); retry when its earlier calls have finished"
            )
        call: _Call[_R] = _Call(
            demand=demand,
            texts=texts,
            embed=embed,
            embed_fast=embed_fast or embed,
            pending=deque(
                (n, r, sum(costs[r.start : r.stop]) + capacity.slice_overhead) for n, r in enumerate(ranges)
            ),
            done=asyncio.get_running_loop().create_future(),
            results=[None] * len(ranges),
            queued_texts=len(texts),
            unfinished=len(ranges),
        )
        if not ranges:
            return []
        if lane is None:
            lane = self._lanes[key] = _Lane(demand.tenant)
            self._rings[demand.work].append(lane)
        lane.calls.append(call)  # type: ignore[arg-type]  # lanes hold calls of any result type
        self._queued(demand.work, lane, len(texts))
        self._dispatch()
        try:
            await call.done
        except BaseException:
            self._withdraw(call)
            raise
        return [result for result in call.results if result is not None]

    def _queued(self, work: WorkClass, lane: _Lane, texts: int) -> None:
        lane.queued_texts += texts
        METRICS.embed_queued.labels(self._embedder, work.label).inc(texts)

    def _dispatch(self) -> None:
        while True:
            if self._free_fast > 0 and (picked := self._next_fast()) is not None:
                self._free_fast -= 1
                self._start(picked, fast=True)
            elif self._free > 0 and (picked := self._next()) is not None:
                self._free -= 1
                self._start(picked, fast=False)
            else:
                return

    def _start(self, picked: tuple[_Call[object], int, range], *, fast: bool) -> None:
        work = picked[0].demand.work
        if not fast:
            self._held[work] += 1
        task = asyncio.get_running_loop().create_task(self._execute(*picked, fast=fast))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    def _next(self) -> tuple[_Call[object], int, range] | None:
        """The next slice for a shared slot: the first class with work that is under its share."""
        for work in WorkClass:
            if self._rings[work] and self._held[work] < self._share(work):
                return self._next_in(work)
        return None

    def _share(self, work: WorkClass) -> int:
        """Shared slots `work` may hold. While a later class waits, one shared slot stays free for
        it (when there are two or more, or when queries have their fast lane), so a flood of one
        class (any tenant's) cannot hold the model from all the others."""
        slots = self._capacity.slots
        later_waits = any(self._rings[later] for later in WorkClass if later > work)
        if later_waits and (slots >= 2 or (work is WorkClass.QUERY and self._capacity.fast_slots)):
            return slots - 1
        return slots

    def _next_in(self, work: WorkClass) -> tuple[_Call[object], int, range] | None:
        """Deficit round-robin over the class's lanes."""
        ring = self._rings[work]
        while ring:
            lane = ring[0]
            if not lane.credited:
                lane.deficit += self._capacity.quantum
                lane.credited = True
            if lane.calls[0].pending[0][2] > lane.deficit:
                lane.credited = False
                ring.rotate(-1)
                continue
            return self._take(work, lane)
        return None

    def _next_fast(self) -> tuple[_Call[object], int, range] | None:
        """Short work for a fast slot: the next query (round-robin between tenants), else the
        first interactive lane whose next slice is short, which then goes to the back of its
        ring (charged to its credit like any slice, so it gains no larger share by it)."""
        if self._rings[WorkClass.QUERY]:
            return self._next_in(WorkClass.QUERY)
        ring = self._rings[WorkClass.INTERACTIVE]
        for lane in ring:
            if lane.calls[0].pending[0][2] - self._capacity.slice_overhead <= self._capacity.fast_chars:
                picked = self._take(WorkClass.INTERACTIVE, lane)
                if lane.calls:  # still queued: the other lanes' short work comes first next time
                    ring.remove(lane)
                    lane.credited = False
                    ring.append(lane)
                return picked
        return None

    def _take(self, work: WorkClass, lane: _Lane) -> tuple[_Call[object], int, range]:
        """Hand out the next slice of `lane`'s first call."""
        call = lane.calls[0]
        number, texts, cost = call.pending.popleft()
        lane.deficit -= cost
        call.queued_texts -= len(texts)
        self._queued(work, lane, -len(texts))
        if not call.pending:
            lane.calls.popleft()
        if not lane.calls:
            self._rings[work].remove(lane)
            del self._lanes[(work, lane.tenant)]
        if call.first_dispatch:
            call.first_dispatch = False
            METRICS.embed_wait_seconds.labels(self._embedder, work.label).observe(
                time.perf_counter() - call.admitted
            )
        return call, number, texts

    async def _execute(self, call: _Call[object], number: int, texts: range, *, fast: bool) -> None:
        try:
            result = await (call.embed_fast if fast else call.embed)(call.texts[texts.start : texts.stop])
        except asyncio.CancelledError:  # the server is shutting down
            if not call.done.done():
                call.done.cancel()
            raise
        except BaseException as exc:
            if not call.done.done():
                call.done.set_exception(exc)
            self._withdraw(call)
        else:
            call.results[number] = result
            call.unfinished -= 1
            if call.unfinished == 0 and not call.done.done():
                call.done.set_result(None)
        finally:
            if fast:
                self._free_fast += 1
            else:
                self._free += 1
                self._held[call.demand.work] -= 1
            self._dispatch()

    def _withdraw(self, call: _Call[_R]) -> None:
        """Drop the call's slices not yet handed out (its caller is gone or one slice failed)."""
        if not call.pending:
            return
        work = call.demand.work
        lane = self._lanes.get((work, call.demand.tenant))
        call.pending.clear()
        if lane is None:
            return
        self._queued(work, lane, -call.queued_texts)
        call.queued_texts = 0
        lane.calls = deque(c for c in lane.calls if c is not call)
        if not lane.calls:
            self._rings[work].remove(lane)
            del self._lanes[(work, lane.tenant)]

    async def aclose(self) -> None:
        """Wait for the slices already running (their callers get their results or errors)."""
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
