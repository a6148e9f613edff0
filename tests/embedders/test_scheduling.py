"""The embedder's fair scheduler: class order, fair shares within a class, bounded queues, callers
that go away. The embed function here is a gate the test opens slice by slice, so the order in
which slices reach "the model" is observed exactly (no clocks)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import numpy as np
import pytest

from tokensvc.embedders import Capacity, Demand, FairScheduler, HashEmbedder, ScheduledEmbedder, WorkClass
from tokensvc.embedders.scheduling import slice_ranges
from tokensvc.errors import ConcurrencyLimit, EmbedderUnavailable
from tokensvc.observability import METRICS

QUERY, INTERACTIVE, BULK = WorkClass.QUERY, WorkClass.INTERACTIVE, WorkClass.BULK


class Gate:
    """Stands where the model would: records each slice as it arrives and holds it until opened."""

    def __init__(self) -> None:
        self.arrived: list[tuple[str, list[str]]] = []
        self._held: list[asyncio.Event] = []
        self.fail: set[str] = set()

    def embed(self, label: str) -> Callable[[list[str]], Awaitable[list[str]]]:
        async def run(texts: list[str]) -> list[str]:
            self.arrived.append((label, texts))
            opened = asyncio.Event()
            self._held.append(opened)
            await opened.wait()
            if label in self.fail:
                raise EmbedderUnavailable("the model failed")
            return texts

        return run

    @property
    def order(self) -> list[str]:
        return [label for label, _ in self.arrived]

    async def open_next(self) -> None:
        """Let the oldest held slice finish, and the scheduler hand out what comes next."""
        self._held.pop(0).set()
        await settle()

    async def open_all(self) -> None:
        while self._held:
            await self.open_next()


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def texts(count: int, chars: int = 10, tag: str = "t") -> list[str]:
    return [f"{tag}{i}".ljust(chars, ".") for i in range(count)]


def start(
    scheduler: FairScheduler, gate: Gate, label: str, demand: Demand, items: list[str]
) -> asyncio.Task[list[list[str]]]:
    return asyncio.ensure_future(scheduler.run(demand, items, gate.embed(label)))


# No per-slice overhead: the orders below are worked out in characters alone.
ONE_SLOT = Capacity(slots=1, slice_texts=2, slice_chars=100, text_chars=100, slice_overhead=0)


async def test_a_small_call_of_another_tenant_goes_before_a_large_calls_remaining_slices() -> None:
    scheduler, gate = FairScheduler("m", ONE_SLOT, tenant_queue_texts=1000), Gate()
    # Ten slices of 100 characters: each uses a whole turn's credit (one quantum).
    large = start(scheduler, gate, "large", Demand(INTERACTIVE, "ns/big"), texts(20, chars=50))
    await settle()
    assert gate.order == ["large"]  # its first slice holds the one slot
    small = start(scheduler, gate, "small", Demand(INTERACTIVE, "ns/small"), texts(1))
    await settle()
    await gate.open_next()
    assert gate.order == ["large", "small"]  # next, not after the other nine slices
    await gate.open_next()
    assert small.done()
    assert not large.done()
    await gate.open_all()
    assert [len(part) for part in await large] == [2] * 10
    assert await small == [texts(1)]


async def test_queries_go_first_then_interactive_writes_then_bulk_work() -> None:
    scheduler, gate = FairScheduler("m", ONE_SLOT, tenant_queue_texts=1000), Gate()
    first = start(scheduler, gate, "first", Demand(BULK, "ns"), texts(2))
    await settle()
    calls = [
        start(scheduler, gate, "bulk", Demand(BULK, "ns"), texts(2)),
        start(scheduler, gate, "write", Demand(INTERACTIVE, "ns/a"), texts(2)),
        start(scheduler, gate, "query", Demand(QUERY, "ns/b"), texts(1)),
    ]
    await settle()
    await gate.open_all()
    assert gate.order == ["first", "query", "write", "bulk"]
    await asyncio.gather(first, *calls)


async def test_tenants_of_one_class_share_the_model_by_characters_not_by_calls() -> None:
    """Deficit round-robin: a tenant sending slices of 100 characters and one sending slices of
    50 get the same characters per round (one slice against two)."""
    scheduler, gate = FairScheduler("m", ONE_SLOT, tenant_queue_texts=1000), Gate()
    blocker = start(scheduler, gate, "blocker", Demand(BULK, "ns-0"), texts(1))
    await settle()
    wide = start(scheduler, gate, "wide", Demand(BULK, "ns-a"), texts(8, chars=50))  # 4 slices of 100
    narrow = start(scheduler, gate, "narrow", Demand(BULK, "ns-b"), texts(16, chars=25, tag="n"))
    await settle()
    await gate.open_all()
    assert gate.order[1:] == [
        "wide",
        "narrow",
        "narrow",
        "wide",
        "narrow",
        "narrow",
        "wide",
        "narrow",
        "narrow",
        "wide",
        "narrow",
        "narrow",
    ]
    await asyncio.gather(blocker, wide, narrow)


FAST = Capacity(
    slots=1, fast_slots=1, fast_chars=30, slice_texts=2, slice_chars=100, text_chars=100, slice_overhead=0
)
TWO_SLOTS = Capacity(
    slots=2, fast_slots=1, fast_chars=30, slice_texts=2, slice_chars=100, text_chars=100, slice_overhead=0
)


async def test_a_query_takes_the_fast_slot_while_every_shared_slot_runs_a_long_write() -> None:
    scheduler, gate = FairScheduler("m", FAST, tenant_queue_texts=1000), Gate()
    write = start(scheduler, gate, "write", Demand(INTERACTIVE, "ns/a"), texts(4, chars=50))
    await settle()
    first = start(scheduler, gate, "query-1", Demand(QUERY, "ns/b"), texts(1))
    second = start(scheduler, gate, "query-2", Demand(QUERY, "ns/c"), texts(1))
    await settle()
    assert gate.order == ["write", "query-1"]  # no wait for the write's slice
    # With one shared slot, queries (which have the fast lane) leave it to the writes.
    await gate.open_next()
    assert gate.order == ["write", "query-1", "write"]
    await gate.open_next()  # query-1's fast slot frees
    assert gate.order == ["write", "query-1", "write", "query-2"]
    await gate.open_all()
    await asyncio.gather(write, first, second)


async def test_a_short_write_takes_the_fast_slot_and_runs_on_the_embedders_fast_lane() -> None:
    scheduler, gate = FairScheduler("m", FAST, tenant_queue_texts=1000), Gate()
    long = start(scheduler, gate, "long", Demand(INTERACTIVE, "ns/a"), texts(6, chars=50))
    bulk = start(scheduler, gate, "bulk", Demand(BULK, "ns"), texts(1))  # short, but bulk work
    await settle()
    short = asyncio.ensure_future(
        scheduler.run(Demand(INTERACTIVE, "ns/b"), texts(2), gate.embed("slow-lane"), gate.embed("fast-lane"))
    )
    await settle()
    assert gate.order == ["long", "fast-lane"]  # bulk work never takes the fast slot
    await gate.open_all()
    assert await short == [texts(2)]
    await asyncio.gather(long, bulk)
    assert gate.order[-1] == "bulk"


async def test_a_flood_of_searches_leaves_a_shared_slot_to_the_writes() -> None:
    scheduler, gate = FairScheduler("m", TWO_SLOTS, tenant_queue_texts=1000), Gate()
    queries = [start(scheduler, gate, "query", Demand(QUERY, "ns/a"), texts(1)) for _ in range(8)]
    await settle()
    assert gate.order == ["query"] * 3  # the fast slot and both shared slots: nothing else waits
    write = start(scheduler, gate, "write", Demand(INTERACTIVE, "ns/b"), texts(2, chars=50))
    await settle()
    await gate.open_next()
    await gate.open_next()
    # Queries now hold at most one shared slot (plus the fast one): the write got the other.
    assert "write" in gate.order
    assert gate.order.index("write") < len(gate.order) - 1 or len(gate.order) < 11
    await gate.open_all()
    await asyncio.gather(write, *queries)


async def test_a_flood_of_interactive_writes_leaves_a_shared_slot_to_uploads() -> None:
    scheduler, gate = FairScheduler("m", TWO_SLOTS, tenant_queue_texts=1000), Gate()
    flood = [
        start(scheduler, gate, "write", Demand(INTERACTIVE, "ns/a"), texts(2, chars=50)) for _ in range(6)
    ]
    await settle()
    upload = start(scheduler, gate, "upload", Demand(BULK, "ns-b"), texts(2, chars=50))
    await settle()
    await gate.open_next()
    assert gate.order == ["write", "write", "upload"]  # not after the six writes
    await gate.open_all()
    await asyncio.gather(upload, *flood)


async def test_the_fast_lane_takes_tenants_short_writes_in_turn() -> None:
    """Tenant a's ten queued one-line Remembers do not all go before tenant b's one."""
    scheduler, gate = FairScheduler("m", FAST, tenant_queue_texts=1000), Gate()
    long = start(scheduler, gate, "long", Demand(INTERACTIVE, "ns/x"), texts(2, chars=50))
    first = start(scheduler, gate, "a", Demand(INTERACTIVE, "ns/a"), texts(1))  # the fast slot
    await settle()
    many = [start(scheduler, gate, "a", Demand(INTERACTIVE, "ns/a"), texts(1)) for _ in range(10)]
    one = start(scheduler, gate, "b", Demand(INTERACTIVE, "ns/b"), texts(1))
    await settle()
    await gate.open_all()
    assert gate.order.index("b") <= 4  # long, a, then b within two more of a's
    await asyncio.gather(long, first, one, *many)


async def test_each_slice_costs_a_fixed_overhead_so_many_small_calls_share_with_one() -> None:
    capacity = Capacity(slots=1, slice_texts=1, slice_chars=100, text_chars=100, slice_overhead=100)
    scheduler, gate = FairScheduler("m", capacity, tenant_queue_texts=1000), Gate()
    blocker = start(scheduler, gate, "blocker", Demand(INTERACTIVE, "ns/x"), texts(1))
    await settle()
    many = start(scheduler, gate, "a", Demand(INTERACTIVE, "ns/a"), texts(20))  # twenty 10-char slices
    one = start(scheduler, gate, "b", Demand(INTERACTIVE, "ns/b"), texts(1))
    await settle()
    await gate.open_all()
    # A turn's credit (200) covers one 110-cost slice and no more: b's comes second, not 21st.
    assert gate.order[1:4] == ["a", "b", "a"]
    await asyncio.gather(blocker, many, one)


async def test_a_tenant_past_its_queue_bound_is_refused_and_others_are_not() -> None:
    scheduler, gate = FairScheduler("m", ONE_SLOT, tenant_queue_texts=10), Gate()
    before = METRICS.embed_refused.labels("m", "interactive")._value.get()
    running = start(scheduler, gate, "a", Demand(INTERACTIVE, "ns/a"), texts(2))  # takes the slot
    await settle()
    queued = start(scheduler, gate, "a", Demand(INTERACTIVE, "ns/a"), texts(8))
    await settle()
    assert scheduler.queued_texts(INTERACTIVE, "ns/a") == 8
    with pytest.raises(ConcurrencyLimit, match="8 texts waiting"):
        await scheduler.run(Demand(INTERACTIVE, "ns/a"), texts(3), gate.embed("a"))
    assert METRICS.embed_refused.labels("m", "interactive")._value.get() == before + 1
    # Another tenant, and the same tenant in another class, have their own bounds.
    other = start(scheduler, gate, "b", Demand(INTERACTIVE, "ns/b"), texts(10))
    bulk = start(scheduler, gate, "a-bulk", Demand(BULK, "ns/a"), texts(10))
    await settle()
    await gate.open_all()
    await asyncio.gather(running, queued, other, bulk)
    assert scheduler.queued_texts(INTERACTIVE) == 0


async def test_a_call_larger_than_the_bound_is_admitted_when_its_tenant_queue_is_empty() -> None:
    """A call that would succeed alone never fails for its size."""
    scheduler, gate = FairScheduler("m", ONE_SLOT, tenant_queue_texts=4), Gate()
    call = start(scheduler, gate, "a", Demand(BULK, "ns"), texts(30))
    await settle()
    await gate.open_all()
    assert sum(len(part) for part in await call) == 30


async def test_a_caller_that_goes_away_takes_its_queued_slices_and_its_running_slice_finishes() -> None:
    scheduler, gate = FairScheduler("m", ONE_SLOT, tenant_queue_texts=1000), Gate()
    doomed = start(scheduler, gate, "doomed", Demand(INTERACTIVE, "ns/a"), texts(10))
    await settle()
    doomed.cancel()
    await settle()
    assert scheduler.queued_texts(INTERACTIVE) == 0
    later = start(scheduler, gate, "later", Demand(INTERACTIVE, "ns/b"), texts(1))
    await settle()
    assert gate.order == ["doomed"]  # the slot is still held by the running slice
    await gate.open_all()
    assert gate.order == ["doomed", "later"]
    assert await later == [texts(1)]
    with pytest.raises(asyncio.CancelledError):
        await doomed


async def test_a_failed_slice_fails_its_call_drops_its_other_slices_and_spares_other_callers() -> None:
    scheduler, gate = FairScheduler("m", ONE_SLOT, tenant_queue_texts=1000), Gate()
    gate.fail.add("broken")
    broken = start(scheduler, gate, "broken", Demand(BULK, "ns-a"), texts(6))
    fine = start(scheduler, gate, "fine", Demand(BULK, "ns-b"), texts(2))
    await settle()
    await gate.open_all()
    with pytest.raises(EmbedderUnavailable):
        await broken
    assert await fine == [texts(2)]
    assert gate.order == ["broken", "fine"]  # broken's other two slices never ran


async def test_slots_bound_the_calls_in_flight() -> None:
    scheduler, gate = FairScheduler("m", Capacity(slots=3, slice_texts=1), tenant_queue_texts=1000), Gate()
    calls = [start(scheduler, gate, f"c{i}", Demand(BULK, f"ns-{i}"), texts(4)) for i in range(3)]
    await settle()
    assert len(gate.arrived) == 3
    await gate.open_next()
    assert len(gate.arrived) == 4
    await gate.open_all()
    await asyncio.gather(*calls)
    assert len(gate.arrived) == 12


async def test_the_queue_gauge_counts_waiting_texts_and_returns_to_zero() -> None:
    scheduler, gate = FairScheduler("gauged", ONE_SLOT, tenant_queue_texts=1000), Gate()
    gauge = METRICS.embed_queued.labels("gauged", "bulk")
    call = start(scheduler, gate, "a", Demand(BULK, "ns"), texts(6))
    await settle()
    assert gauge._value.get() == 4  # two texts went to the model, four wait
    await gate.open_all()
    await call
    assert gauge._value.get() == 0


@pytest.mark.parametrize(
    ("costs", "size", "chars", "expected"),
    [
        ([], 4, 100, []),
        ([10] * 5, 2, 100, [range(0, 2), range(2, 4), range(4, 5)]),
        ([60, 60, 10, 10], 10, 100, [range(0, 1), range(1, 4)]),
        ([500, 1], 10, 100, [range(0, 1), range(1, 2)]),  # one text alone may exceed `chars`
    ],
)
def test_slices_hold_at_most_size_items_and_chars_of_cost(
    costs: list[int], size: int, chars: int, expected: list[range]
) -> None:
    assert slice_ranges(costs, size, chars) == expected


async def test_a_scheduled_embedder_returns_the_rows_its_embedder_would_in_order() -> None:
    hashing = HashEmbedder(dimension=64)
    scheduled = ScheduledEmbedder(hashing, tenant_queue_texts=10_000)
    items = [f"fact number {i} about item {i * 7}" for i in range(600)]  # three slices of 256 at most
    direct = await hashing.embed_documents(items)
    got = await scheduled.embed_documents(items, Demand(BULK, "ns"))
    assert got.shape == (600, 64)
    assert got.flags.c_contiguous
    np.testing.assert_array_equal(got, direct)
    np.testing.assert_array_equal(
        await scheduled.embed_query("fact", "ns/a"), await hashing.embed_query("fact")
    )
    assert (await scheduled.embed_documents([], Demand(BULK, "ns"))).shape == (0, 64)
