"""DataSubjectRequests over the in-process stores: batches, pepper versions, the resume token, and
what a receipt and its audit event hold (never the user id)."""

from __future__ import annotations

import base64
import json
import os

import pytest

from tests.storage.conformance.support import SPACE, axis, memory
from tokensvc.audit import AuditLog
from tokensvc.auth.buckets import PepperKeyring, all_bucket_ids
from tokensvc.errors import DatabaseUnavailable, InvalidArgument, NotFound
from tokensvc.memory.data_subjects import DataSubjectRequests, ReceiptKind
from tokensvc.storage.inprocess import InProcessAuditStore, InProcessDataSubjectStore, InProcessMemoryStore
from tokensvc.storage.records import Tenant

USER = "unit-subject-7f3c"
KEYRING = PepperKeyring({1: os.urandom(32), 2: os.urandom(32)})


async def stores() -> tuple[DataSubjectRequests, InProcessMemoryStore, InProcessAuditStore]:
    memories, audit = InProcessMemoryStore(), InProcessAuditStore()
    requests = DataSubjectRequests(
        InProcessDataSubjectStore(memories), lambda: KEYRING, AuditLog(audit), batch_size=2
    )
    for agent, per_version in (("agent-a", (3, 2)), ("agent-b", (0, 1)), ("agent-c", (0, 0))):
        await memories.pin_space(Tenant("ns", agent), SPACE)
        newest, older = all_bucket_ids(KEYRING, "ns", agent, USER)
        for bucket, count in ((newest, per_version[0]), (older, per_version[1])):
            tenant = Tenant("ns", agent, (bucket,))
            await memories.insert(
                tenant, bucket, [memory(f"{agent} {bucket[:2]} {i}", axis(i)) for i in range(count)]
            )
        someone = all_bucket_ids(KEYRING, "ns", agent, "someone-else")[0]
        await memories.insert(Tenant("ns", agent, (someone,)), someone, [memory(f"{agent} other", axis(0))])
    return requests, memories, audit


async def test_an_export_lists_every_pepper_version_and_resumes_anywhere() -> None:
    requests, _, _ = await stores()
    items = [item async for item in requests.export("ns", USER, actor="cp")]
    memories = [i for i in items if i.memory is not None]
    assert [(m.memory.agent if m.memory else "") for m in memories] == ["agent-a"] * 5 + ["agent-b"]
    prefixes = [i.key_prefix for i in items if i.key_prefix is not None]
    assert len(prefixes) == 6  # three agents, two pepper versions
    assert items[-1].receipt is not None
    assert (items[-1].receipt.kind, items[-1].receipt.memories, items[-1].receipt.agents) == (
        ReceiptKind.EXPORT,
        6,
        3,
    )
    for cut in range(len(memories)):
        rest = [
            i async for i in requests.export("ns", USER, actor="cp", resume_token=memories[cut].resume_token)
        ]
        assert [i.memory.memory.id for i in rest if i.memory] == [
            m.memory.memory.id for m in memories[cut + 1 :] if m.memory
        ]


async def test_an_erasure_works_in_batches_leaves_others_and_audits_no_user_id() -> None:
    requests, memories, audit = await stores()
    erasure = await requests.erase("ns", USER, actor="spiffe://cp")
    assert [(a.agent, a.memories) for a in erasure.receipt.per_agent] == [("agent-a", 5), ("agent-b", 1)]
    assert len(erasure.key_prefixes) == 6
    assert all(p.startswith("mem:ns/agent-") and p.endswith(":") for p in erasure.key_prefixes)
    assert (await requests.erase("ns", USER, actor="spiffe://cp")).receipt.memories == 0
    others = [row.content for bucket in memories.tables.rows.values() for row in bucket.values()]
    assert sorted(others) == ["agent-a other", "agent-b other", "agent-c other"]
    assert await requests.receipt(erasure.receipt.id) == erasure.receipt
    events = await audit.page(before_id=None, kinds=[], since=None, until=None, limit=100)
    assert [e.outcome for e in reversed(events)] == ["started", "succeeded", "started", "succeeded"]
    assert all(USER not in repr(event) for event in events)
    assert USER not in repr(erasure.receipt)


async def test_bad_requests_name_their_field() -> None:
    requests, _, _ = await stores()
    for user in ("", "x" * 513, "nul\x00inside", "\ud800"):
        with pytest.raises(InvalidArgument) as refused:
            await requests.erase("ns", user, actor="cp")
        assert refused.value.field == "user_id"
    out_of_range = _token(
        ["ns", "agent-a", "v1.abc", "0001-01-01T00:00:00+05:00", "6b1f1c0e-5a61-4d7f-9f0e-2d7a1c6b8e44"]
    )
    for token in ("garbage", "eyJ4Ijp0cnVlfQ", "WyJucyIsImEiLCJiIiwieCIsInkiXQ", out_of_range):
        with pytest.raises(InvalidArgument) as refused:
            _ = [i async for i in requests.export("ns", USER, actor="cp", resume_token=token)]
        assert refused.value.field == "resume_token"
    with pytest.raises(NotFound):
        await requests.receipt("6b1f1c0e-5a61-4d7f-9f0e-2d7a1c6b8e44")


def _token(parts: list[str]) -> str:
    return base64.urlsafe_b64encode(json.dumps(parts).encode()).decode().rstrip("=")


async def test_every_user_a_capability_can_name_can_be_erased() -> None:
    requests, _, _ = await stores()
    for user in (" ", "\U0001f600" * 512):  # whitespace, and 512 characters of 4 bytes each
        assert (await requests.erase("ns", user, actor="cp")).receipt.complete


async def test_extra_agents_get_their_session_key_prefixes_too() -> None:
    requests, _, _ = await stores()
    erasure = await requests.erase("ns", USER, actor="cp", extra_agents=["session-only", "agent-a"])
    assert erasure.receipt.agents == 4  # three spaces and the session-only agent, once each
    assert [p for p in erasure.key_prefixes if p.startswith("mem:ns/session-only:")] == [
        f"mem:ns/session-only:{b}:" for b in all_bucket_ids(KEYRING, "ns", "session-only", USER)
    ]


class _FailingSecondBatch(InProcessDataSubjectStore):
    def __init__(self, memories: InProcessMemoryStore) -> None:
        super().__init__(memories)
        self.batches = 0

    async def erase(self, tenant: Tenant, *, limit: int) -> int:
        self.batches += 1
        if self.batches == 2:
            raise DatabaseUnavailable()
        return await super().erase(tenant, limit=limit)


async def test_an_erasure_cut_off_part_of_the_way_records_what_it_erased() -> None:
    _, memories, audit = await stores()
    store = _FailingSecondBatch(memories)
    requests = DataSubjectRequests(store, lambda: KEYRING, AuditLog(audit), batch_size=2)
    with pytest.raises(DatabaseUnavailable):
        await requests.erase("ns", USER, actor="cp")
    events = await audit.page(before_id=None, kinds=[], since=None, until=None, limit=100)
    assert [(e.outcome, e.action) for e in reversed(events)] == [
        ("started", "erasure of an end-user's memories"),
        ("failed", "erasure of an end-user's memories"),
    ]
    receipt_id = events[0].target.split()[0].removeprefix("receipt:")
    partial = await requests.receipt(receipt_id)
    assert (partial.complete, partial.memories, [a.agent for a in partial.per_agent]) == (
        False,
        2,
        ["agent-a"],
    )
    again = await DataSubjectRequests(
        InProcessDataSubjectStore(memories), lambda: KEYRING, AuditLog(audit)
    ).erase("ns", USER, actor="cp")
    assert (again.receipt.complete, again.receipt.memories) == (True, 4)
