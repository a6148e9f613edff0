"""Property-based fuzzing of every RPC of every service over one live mTLS tokensvc.

Hypothesis generates each request message, valid and invalid (tests/fuzz/rpcs.py): random and
edge-case unicode, huge and empty values, NaN/infinite floats and vectors, unknown enum numbers,
deep and wide filters, random metadata maps, forged page tokens, upload streams in any order,
damaged authorization and trace headers, and one request in ten as damaged wire bytes (truncated,
appended garbage, filters nested past protobuf's depth limit). Each RPC is sent with the
certificate of a role allowed to call it (a launcher with a capability for the launcher RPCs, the
control plane, an admin). Every answer must be OK or a deliberate status that carries a stable
reason, never INTERNAL or UNKNOWN, never a hang; the server's own record of each call
(tokensvc_rpcs_total) must agree (tests/fuzz/target.py). After each test the server still answers
health checks with SERVING and nothing of another tenant, nor the canaries, changed.

Credential rotation is fuzzed with UNSPECIFIED and unknown modes only: RELOAD and ROTATE change
the shared credentials.
"""

from __future__ import annotations

import collections
import uuid
from typing import Any

import grpc
import pytest
from google.protobuf import timestamp_pb2
from hypothesis import strategies as st

from tests.fuzz.rpcs import RPCS, Rpc, authorization, call, rpc_named
from tests.fuzz.strategies import forged_memory_token, fuzzed, length_delimited, nested_filter, wire
from tests.fuzz.target import CANARY_KB, FUZZ_NS, KB_A, TIMEOUT, Target
from tests.support import b64url, bearer
from tokensvc.api.policy import POLICIES
from tokensvc.auth.identity import Role
from tokensvc.v1 import (
    admin_pb2,
    capability_pb2,
    common_pb2,
    knowledge_pb2,
    knowledge_pb2_grpc,
    memory_pb2,
    memory_pb2_grpc,
)

EXAMPLES = 120  # per RPC; 24 RPCs
ROLES = {"launcher": Role.LAUNCHER, "control-plane": Role.CONTROL_PLANE, "admin": Role.ADMIN}


def test_every_rpc_of_every_service_is_fuzzed_by_a_role_allowed_to_call_it() -> None:
    declared = {
        f"{service.name}/{method.name}"
        for module in (admin_pb2, capability_pb2, knowledge_pb2, memory_pb2)
        for service in module.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    }
    assert {rpc.name for rpc in RPCS} == declared
    for rpc in RPCS:
        policy = POLICIES[f"/tokensvc.v1.{rpc.name}"]
        assert ROLES[rpc.role] in policy.roles, rpc.name
        assert policy.needs_capability == (rpc.role == "launcher"), rpc.name


@pytest.mark.parametrize("rpc", RPCS, ids=lambda rpc: rpc.id)
@fuzzed(EXAMPLES)
async def test_fuzzed_request_gets_a_deliberate_status(
    fuzz: Target, tally: collections.Counter[str], rpc: Rpc, data: st.DataObject
) -> None:
    request = rpc.draw(data, fuzz)
    if data.draw(st.integers(1, 100), label="raw") <= 10:
        # One in ten requests goes out as damaged wire bytes instead.
        as_wire = st.composite(lambda draw, message: wire(draw, rpc.method, message))
        if rpc.stream:
            request = [data.draw(as_wire(part)) for part in request] or [b"\xff"]
        else:
            request = data.draw(as_wire(request), label="wire")
    metadata: tuple[tuple[str, str], ...] = ()
    if rpc.role == "launcher":
        metadata = data.draw(authorization(fuzz), label="metadata")
    tally[(await call(fuzz, rpc, request, metadata)).code] += 1


def found_by_fuzzing() -> list[Any]:
    """Inputs that once got INTERNAL, UNKNOWN or an unreadable status (here, or in the attack run
    of issue 14); each must now be refused with INVALID_ARGUMENT naming the field."""
    memory_filter_tag_token = forged_memory_token(b"", "0001-01-01T00:00:00+14:00", str(uuid.uuid4()))
    list_memories = memory_pb2.ListMemoriesRequest(page_size=2).SerializeToString()

    def json_token(body: str) -> str:
        return b64url(body.encode())

    def case(method: str, request: Any, field: str, id: str) -> Any:
        return pytest.param(method, request, field, id=id)

    return [
        # str.isdigit() accepts "²", int() does not.
        case(
            "ListAuditEvents",
            admin_pb2.ListAuditEventsRequest(page_token="²"),
            "page_token",
            "audit-superscript",
        ),
        case(
            "ListAuditEvents",
            admin_pb2.ListAuditEventsRequest(page_token="9999999999999999999"),
            "page_token",
            "audit-token-past-int64",
        ),
        case(
            "ListAuditEvents",
            admin_pb2.ListAuditEventsRequest(since=timestamp_pb2.Timestamp(nanos=-1)),
            "since",
            "audit-negative-nanos",
        ),
        case(
            "ListAuditEvents",
            admin_pb2.ListAuditEventsRequest(until=timestamp_pb2.Timestamp(seconds=2**40)),
            "until",
            "audit-until-past-year-9999",
        ),
        # PostgreSQL text cannot hold U+0000.
        case(
            "RevokeCapability", capability_pb2.RevokeCapabilityRequest(jti="a\x00b"), "jti", "revoke-nul-jti"
        ),
        case(
            "RevokeCapability",
            capability_pb2.RevokeCapabilityRequest(run_id="run", reason="\x00"),
            "reason",
            "revoke-nul-reason",
        ),
        case(
            "ListKnowledgeBases",
            knowledge_pb2.ListKnowledgeBasesRequest(namespace=FUZZ_NS, page_token=b64url(b"a\x00")),
            "page_token",
            "bases-nul-token",
        ),
        case(
            "ListDocuments",
            knowledge_pb2.ListDocumentsRequest(
                namespace=FUZZ_NS, knowledge_base_ref=KB_A, page_token=b64url(b"a\x00")
            ),
            "page_token",
            "documents-nul-token",
        ),
        # A page position with no UTC value.
        case(
            "ListMemories",
            memory_pb2.ListMemoriesRequest(page_token=memory_filter_tag_token),
            "page_token",
            "memories-token-before-year-1",
        ),
        # Issue 14, finding 2: the right keys with wrong value types (uuid.UUID(1) raised).
        *[
            case(
                "ListMemories",
                memory_pb2.ListMemoriesRequest(page_token=json_token(body)),
                "page_token",
                f"memories-token-{name}",
            )
            for name, body in (
                ("id-a-number", '{"c": "2026-01-01T00:00:00+00:00", "i": 1, "f": "x"}'),
                ("id-a-list", '{"c": "2026-01-01T00:00:00+00:00", "i": [1], "f": "x"}'),
                ("id-an-object", '{"c": "2026-01-01T00:00:00+00:00", "i": {"a": 1}, "f": "x"}'),
                ("id-a-lone-surrogate", '{"c": "2026-01-01T00:00:00+00:00", "i": "\\ud800", "f": "x"}'),
                ("time-a-huge-number", '{"c": 1' + "0" * 400 + ', "i": "x", "f": "x"}'),
                ("a-list", "[1, 2, 3]"),
                ("deeply-nested", "[" * 300 + "]" * 300),
            )
        ],
        # Issue 14, finding 2: NUL in a HYBRID knowledge query, with a knowledge base on the roster.
        case(
            "SearchKnowledge",
            knowledge_pb2.SearchKnowledgeRequest(
                knowledge_base_refs=[KB_A], query_text="tides\x00", mode=common_pb2.SEARCH_MODE_HYBRID
            ),
            "query_text",
            "knowledge-hybrid-nul",
        ),
        # Issue 14, finding 3: NUL in a display name.
        case(
            "CreateKnowledgeBase",
            knowledge_pb2.CreateKnowledgeBaseRequest(
                namespace=FUZZ_NS,
                ref="kb-fuzz-nul",
                display_name="a\x00b",
                chunking=knowledge_pb2.ChunkingStrategy(kind=knowledge_pb2.CHUNKING_KIND_FIXED),
            ),
            "display_name",
            "create-nul-display-name",
        ),
        # Issue 14, finding 4: a trailing newline is no part of a name.
        *[
            case(
                "CreateKnowledgeBase",
                knowledge_pb2.CreateKnowledgeBaseRequest(
                    namespace=namespace,
                    ref=ref,
                    chunking=knowledge_pb2.ChunkingStrategy(kind=knowledge_pb2.CHUNKING_KIND_FIXED),
                ),
                field,
                f"create-newline-{field}",
            )
            for namespace, ref, field in (
                (f"{FUZZ_NS}\n", "kb-fuzz-nl", "namespace"),
                (FUZZ_NS, "rt-nl\n", "ref"),
            )
        ],
        case(
            "IssueCapability",
            capability_pb2.IssueCapabilityRequest(namespace=FUZZ_NS, agent="agent-fuzz", run_id="run-1\n"),
            "run_id",
            "issue-newline-run-id",
        ),
        # An error message quoting 100 KB of the caller's input (over gRPC's 16 KiB trailer limit).
        case(
            "CreateKnowledgeBase",
            knowledge_pb2.CreateKnowledgeBaseRequest(
                namespace=FUZZ_NS,
                ref="kb-fuzz-new",
                embedder="é" * 50_000,
                chunking=knowledge_pb2.ChunkingStrategy(kind=knowledge_pb2.CHUNKING_KIND_FIXED),
            ),
            "embedder",
            "create-huge-embedder",
        ),
        # Bytes that do not parse: corrupt, and a filter nested past protobuf's depth limit.
        case("GetCredentialStatus", b"\xff\xff\xff", "request", "wire-corrupt"),
        case(
            "ListMemories",
            list_memories + length_delimited(3, nested_filter(150)),
            "request",
            "wire-deep-filter",
        ),
        case("UploadDocument", [b"\x0a\xff"], "request", "wire-upload"),
    ]


@pytest.mark.parametrize(("method", "request_", "field"), found_by_fuzzing())
async def test_inputs_found_by_fuzzing_are_invalid_arguments_naming_the_field(
    fuzz: Target, tally: collections.Counter[str], method: str, request_: Any, field: str
) -> None:
    rpc = rpc_named(method)
    metadata = bearer(fuzz.token) if rpc.role == "launcher" else ()
    answer = await call(fuzz, rpc, request_, metadata)
    tally[answer.code] += 1
    assert answer.code == "INVALID_ARGUMENT", answer
    assert field in answer.fields or answer.misreported, answer


async def test_the_fuzzed_tenant_still_works_end_to_end(fuzz: Target) -> None:
    memory = memory_pb2_grpc.MemoryServiceStub(fuzz.channels["launcher"])
    remembered = await memory.Remember(
        memory_pb2.RememberRequest(items=[memory_pb2.RememberItem(content="still alive")]),
        metadata=bearer(fuzz.token),
        timeout=TIMEOUT,
    )
    got = await memory.GetMemory(
        memory_pb2.GetMemoryRequest(id=remembered.results[0].id), metadata=bearer(fuzz.token), timeout=TIMEOUT
    )
    assert got.memory.content == "still alive"
    control = knowledge_pb2_grpc.KnowledgeServiceStub(fuzz.channels["control-plane"])
    canary = await control.GetKnowledgeBase(
        knowledge_pb2.GetKnowledgeBaseRequest(namespace=FUZZ_NS, ref=CANARY_KB), timeout=TIMEOUT
    )
    assert canary.knowledge_base.ref == CANARY_KB
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await memory.GetMemory(memory_pb2.GetMemoryRequest(id="not-a-uuid"), metadata=bearer(fuzz.token))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
