"""DataSubjectRequests over the in-memory stores: batches, pepper versions, the resume token, and
what a receipt and its audit event hold (never the user id)."""

from __future__ import annotations

import os

import pytest

from tests.storage.conformance.support import SPACE, axis, memory
from tokensvc.audit import AuditLog
from tokensvc.auth.buckets import PepperKeyring, all_bucket_ids
from tokensvc.errors import InvalidArgument, NotFound
from tokensvc.memory.data_subjects import DataSubjectRequests, ReceiptKind
from tokensvc.storage.memory import InMemoryAuditStore, InMemoryDataSubjectStore, InMemoryMemoryStore
from tokensvc.storage.records import Tenant

USER = "unit-subject-7f3c"
KEYRING = PepperKeyring({1: os.urandom(32), 2: os.urandom(32)})


async def stores() -> tuple[DataSubjectRequests, InMemoryMemoryStore, InMemoryAuditStore]:
    memories, audit = InMemoryMemoryStore(), InMemoryAuditStore()
    requests = DataSubjectRequests(
        InMemoryDataSubjectStore(memories), lambda: KEYRING, AuditLog(audit), batch_size=2
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
    others = [row.content for bucket in memories._rows.values() for row in bucket.values()]
    assert sorted(others) == ["agent-a other", "agent-b other", "agent-c other"]
    assert await requests.receipt(erasure.receipt.id) == erasure.receipt
    events = await audit.page(before_id=None, kinds=[], since=None, until=None, limit=100)
    assert len(events) == 2
    assert all(USER not in repr(event) for event in events)
    assert USER not in repr(erasure.receipt)


async def test_bad_requests_name_their_field() -> None:
    requests, _, _ = await stores()
    for user in ("", "   ", "x" * 1025):
        with pytest.raises(InvalidArgument) as refused:
            await requests.erase("ns", user, actor="cp")
        assert refused.value.field == "user_id"
    for token in ("garbage", "eyJ4Ijp0cnVlfQ", "WyJucyIsImEiLCJiIiwieCIsInkiXQ"):
        with pytest.raises(InvalidArgument) as refused:
            _ = [i async for i in requests.export("ns", USER, actor="cp", resume_token=token)]
        assert refused.value.field == "resume_token"
    with pytest.raises(NotFound):
        await requests.receipt("6b1f1c0e-5a61-4d7f-9f0e-2d7a1c6b8e44")
