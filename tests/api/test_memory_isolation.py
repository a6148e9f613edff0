"""Tenant isolation through every MemoryService RPC: another bucket's memory does not exist.

Three kinds of neighbours are tried everywhere: two agents; two end-users of one agent whose
capabilities say `per_user`; and one agent's agent-wide bucket next to one of its users' buckets.
The database is checked directly (as the superuser, beneath row-level security) to show that
refused writes left the owner's rows exactly as they were.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from tests.api.memory_support import (
    Caller,
    Launchers,
    count_rows,
    meta,
    metadata_of,
    pack,
    snapshot,
    ttl,
)
from tests.support import SharedDatabase
from tokensvc.embedders import HashEmbedder
from tokensvc.v1 import common_pb2, memory_pb2

SECRET = "the owner's secret recipe uses saffron and cardamom"
OWN = "the intruder's own note about weather"
HYBRID = common_pb2.SEARCH_MODE_HYBRID


@dataclass(frozen=True)
class Neighbours:
    owner: Caller
    intruder: Caller
    secret_id: str
    own_id: str


@pytest.fixture(params=["two-agents", "two-users-of-one-agent", "user-vs-agent-wide", "agent-wide-vs-user"])
async def neighbours(request: pytest.FixtureRequest, launchers: Launchers) -> Neighbours:
    """An owner holding SECRET and an intruder holding OWN, in different buckets."""
    agent = launchers.new_agent()
    user_x = launchers.caller(agent, user="user-x", per_user=True)
    owner, intruder = {
        "two-agents": lambda: (launchers.caller(agent), launchers.caller()),
        "two-users-of-one-agent": lambda: (user_x, launchers.caller(agent, user="user-y", per_user=True)),
        "user-vs-agent-wide": lambda: (user_x, launchers.caller(agent, user="user-x")),
        "agent-wide-vs-user": lambda: (launchers.caller(agent, user="user-x"), user_x),
    }[request.param]()
    [secret_id] = await owner.remember(
        memory_pb2.RememberItem(content=SECRET, metadata={"kind": meta("recipe")}, idempotency_key="k-1")
    )
    [own_id] = await intruder.remember(
        memory_pb2.RememberItem(content=OWN, metadata={"kind": meta("recipe")})
    )
    assert await owner.bucket() != await intruder.bucket()
    return Neighbours(owner, intruder, secret_id, own_id)


def agents_of(pair: Neighbours) -> list[str]:
    return sorted({pair.owner.agent, pair.intruder.agent})


async def owner_rows(database: SharedDatabase, pair: Neighbours) -> list[tuple[Any, ...]]:
    bucket = await pair.owner.bucket()
    return [row for row in await snapshot(database, agents_of(pair)) if row[0] == bucket]


# --- every RPC, per kind of neighbour ----------------------------------------------------------


async def test_remember_in_another_bucket_never_deduplicates_against_the_owner(
    neighbours: Neighbours, database: SharedDatabase
) -> None:
    before = await owner_rows(database, neighbours)
    same = memory_pb2.RememberItem(content=SECRET, idempotency_key="k-1")
    response = await neighbours.intruder.call("Remember", memory_pb2.RememberRequest(items=[same]))
    [result] = response.results
    assert result.deduplicated is False
    assert result.id != neighbours.secret_id
    assert await owner_rows(database, neighbours) == before


@pytest.mark.parametrize("how", ["vector-text", "hybrid-text", "vector-bytes"])
async def test_search_never_returns_another_buckets_memories(neighbours: Neighbours, how: str) -> None:
    fields: dict[str, Any] = {"top_k": 100}
    if how == "hybrid-text":
        fields["mode"] = HYBRID
    query: str | bytes = SECRET if how != "vector-bytes" else pack(HashEmbedder().vectorize([SECRET])[0])
    found = await neighbours.intruder.search(query, **fields)
    assert [r.memory.id for r in found] == [neighbours.own_id]
    filtered = await neighbours.intruder.search(
        query,
        filter=common_pb2.Filter(
            field=common_pb2.FieldFilter(
                key="kind",
                operator=common_pb2.FILTER_OPERATOR_EQ,
                value=meta("recipe"),
            )
        ),
        **fields,
    )
    assert neighbours.secret_id not in {r.memory.id for r in filtered}
    # The owner, asking the same, finds it first: the search itself works.
    assert (await neighbours.owner.search(query, **fields))[0].memory.id == neighbours.secret_id


async def test_get_of_another_buckets_memory_is_not_found(neighbours: Neighbours) -> None:
    request = memory_pb2.GetMemoryRequest(id=neighbours.secret_id)
    failure = await neighbours.intruder.fail("GetMemory", request)
    assert (failure.code, failure.reason) == (grpc.StatusCode.NOT_FOUND, "NOT_FOUND")
    assert (await neighbours.owner.call("GetMemory", request)).memory.content == SECRET


async def test_list_never_includes_another_buckets_memories(neighbours: Neighbours) -> None:
    assert [m.id for m in await neighbours.intruder.list_all(page_size=1)] == [neighbours.own_id]
    assert [m.id for m in await neighbours.owner.list_all(page_size=1)] == [neighbours.secret_id]


@pytest.mark.parametrize(
    "change",
    [
        {"content": "overwritten by the intruder"},
        {"metadata": {"kind": meta("stolen")}},
        {"replace_metadata": True},
        {"ttl": ttl(1)},
    ],
    ids=["content", "metadata", "replace-metadata", "ttl"],
)
async def test_update_of_another_buckets_memory_is_not_found_and_changes_nothing(
    neighbours: Neighbours, database: SharedDatabase, change: dict[str, Any]
) -> None:
    before = await owner_rows(database, neighbours)
    request = memory_pb2.UpdateMemoryRequest(id=neighbours.secret_id, **change)
    failure = await neighbours.intruder.fail("UpdateMemory", request)
    assert (failure.code, failure.reason) == (grpc.StatusCode.NOT_FOUND, "NOT_FOUND")
    assert await owner_rows(database, neighbours) == before
    got = await neighbours.owner.call("GetMemory", memory_pb2.GetMemoryRequest(id=neighbours.secret_id))
    assert metadata_of(got.memory) == {"kind": "recipe"}


async def test_forget_of_another_buckets_memory_counts_zero_and_keeps_the_row(
    neighbours: Neighbours, database: SharedDatabase
) -> None:
    before = await owner_rows(database, neighbours)
    alone = await neighbours.intruder.call("Forget", memory_pb2.ForgetRequest(ids=[neighbours.secret_id]))
    assert alone.forgotten_count == 0
    request = memory_pb2.ForgetRequest(ids=[neighbours.secret_id, neighbours.own_id])
    response = await neighbours.intruder.call("Forget", request)
    assert response.forgotten_count == 1  # its own memory only
    assert await owner_rows(database, neighbours) == before
    assert len(before) == 1


async def test_forget_all_of_the_intruder_leaves_the_owners_rows_intact(
    neighbours: Neighbours, database: SharedDatabase
) -> None:
    before = await owner_rows(database, neighbours)
    response = await neighbours.intruder.call("ForgetAll", memory_pb2.ForgetAllRequest())
    assert response.forgotten_count == 1
    assert await count_rows(database, await neighbours.intruder.bucket()) == 0
    assert await owner_rows(database, neighbours) == before
    assert len(before) == 1


# --- a neighbour that has never written ---------------------------------------------------------


async def test_an_agent_with_no_memories_sees_and_touches_nothing_of_another(
    launchers: Launchers, database: SharedDatabase
) -> None:
    owner, stranger = launchers.caller(), launchers.caller()
    [secret_id] = await owner.remember(SECRET)
    before = await snapshot(database, [owner.agent, stranger.agent])
    assert (await stranger.fail("GetMemory", memory_pb2.GetMemoryRequest(id=secret_id))).code == (
        grpc.StatusCode.NOT_FOUND
    )
    update = memory_pb2.UpdateMemoryRequest(id=secret_id, content="mine now")
    assert (await stranger.fail("UpdateMemory", update)).code == grpc.StatusCode.NOT_FOUND
    assert await stranger.search(SECRET) == []
    assert await stranger.search(pack(HashEmbedder().vectorize([SECRET])[0])) == []
    assert await stranger.list_all() == []
    forget = memory_pb2.ForgetRequest(ids=[secret_id])
    assert (await stranger.call("Forget", forget)).forgotten_count == 0
    assert (await stranger.call("ForgetAll", memory_pb2.ForgetAllRequest())).forgotten_count == 0
    assert await snapshot(database, [owner.agent, stranger.agent]) == before


# --- the `ltm` grant ----------------------------------------------------------------------------


def every_rpc(memory_id: str) -> list[tuple[str, Any]]:
    return [
        ("Remember", memory_pb2.RememberRequest(items=[memory_pb2.RememberItem(content="new fact")])),
        ("SearchMemories", memory_pb2.SearchMemoriesRequest(query_text="secret")),
        ("SearchMemories", memory_pb2.SearchMemoriesRequest(query_text="secret", mode=HYBRID)),
        ("SearchMemories", memory_pb2.SearchMemoriesRequest(query_vector=pack([1.0] * 384))),
        ("GetMemory", memory_pb2.GetMemoryRequest(id=memory_id)),
        ("ListMemories", memory_pb2.ListMemoriesRequest()),
        ("UpdateMemory", memory_pb2.UpdateMemoryRequest(id=memory_id, content="changed")),
        ("Forget", memory_pb2.ForgetRequest(ids=[memory_id])),
        ("ForgetAll", memory_pb2.ForgetAllRequest()),
    ]


@pytest.mark.parametrize("index", range(9), ids=[f"{rpc}-{i}" for i, (rpc, _) in enumerate(every_rpc(""))])
async def test_capability_without_ltm_is_scope_not_granted_for_every_rpc(
    launchers: Launchers, database: SharedDatabase, index: int
) -> None:
    agent = launchers.new_agent()
    [memory_id] = await launchers.caller(agent).remember(SECRET)
    denied = launchers.caller(agent, ltm=False)
    before = await snapshot(database, [agent])
    rpc, request = every_rpc(memory_id)[index]
    failure = await denied.fail(rpc, request)
    assert (failure.code, failure.reason) == (grpc.StatusCode.PERMISSION_DENIED, "SCOPE_NOT_GRANTED")
    assert await snapshot(database, [agent]) == before


# --- by design: without per_user, the users of one agent share its agent-wide bucket -----------


async def test_users_without_per_user_share_the_agent_wide_bucket_by_design(launchers: Launchers) -> None:
    """Documented behaviour, not a leak: `per_user` is what isolates end-users of one agent.

    A capability without `per_user` addresses the agent-wide bucket (memory.proto, MemoryService),
    whatever its `user` claim says, so every such run of the agent shares one memory.
    """
    agent = launchers.new_agent()
    alice = launchers.caller(agent, user="alice")
    bob = launchers.caller(agent, user="bob")
    anonymous = launchers.caller(agent)
    assert await alice.bucket() == await bob.bucket() == await anonymous.bucket()
    [memory_id] = await alice.remember(SECRET)
    again = await bob.call(
        "Remember", memory_pb2.RememberRequest(items=[memory_pb2.RememberItem(content=SECRET)])
    )
    assert [(r.id, r.deduplicated) for r in again.results] == [(memory_id, True)]
    assert (await bob.call("GetMemory", memory_pb2.GetMemoryRequest(id=memory_id))).memory.content == SECRET
    assert (await anonymous.search(SECRET))[0].memory.id == memory_id
    # ...while the same users with per_user have buckets of their own, separate from it.
    private = launchers.caller(agent, user="alice", per_user=True)
    assert await private.bucket() != await alice.bucket()
    assert await private.search(SECRET) == []
