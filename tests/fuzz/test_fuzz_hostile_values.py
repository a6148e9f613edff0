"""Hostile strings in any string field of any request, and forged page tokens, over the live server.

Each example draws a request the way tests/fuzz/rpcs.py does (valid mostly) and makes one of its
strings hostile (strategies.poisoned): a NUL, a line break (a trailing "\\n" is what a `$`-anchored
pattern lets through), an invisible or look-alike character, a length past every limit, or a lone
surrogate, which protobuf cannot encode and so goes out as its bytes on the wire. The answer is
deliberate, a lone surrogate is a malformed request, and nothing stored elsewhere changes (the
`tally` fixture checks the canaries and the other tenants after each test; names stored in the
fuzzer's namespaces must be valid names).

Forged page tokens go to the four paging RPCs in otherwise valid requests: the answer is a page,
or INVALID_ARGUMENT naming `page_token` and nothing else.
"""

from __future__ import annotations

import collections

import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import strategies as st

from tests.fuzz.hostile import (
    NUMBER_PAGE_TOKENS,
    carries_surrogate_mark,
    poisoned,
    text_page_tokens,
    with_lone_surrogates,
)
from tests.fuzz.rpcs import RPCS, Rpc, call, memory_page_tokens, rpc_named
from tests.fuzz.strategies import fuzzed, page_tokens
from tests.fuzz.target import FUZZ_NS, KB_A, Target
from tests.support import bearer
from tokensvc.v1 import admin_pb2, capability_pb2, knowledge_pb2, memory_pb2

HOSTILE_EXAMPLES = 40  # per RPC
TOKEN_EXAMPLES = 60  # per paging RPC
DEEP_EXAMPLES = 400  # per RPC, in the slow variants (`make test`; `make test-fast` skips them)
MODULES = (admin_pb2, capability_pb2, knowledge_pb2, memory_pb2)


def request_type(rpc: Rpc) -> Descriptor:
    for module in MODULES:
        service = module.DESCRIPTOR.services_by_name.get(rpc.service)
        if service is not None:
            return service.methods_by_name[rpc.method].input_type
    raise LookupError(rpc.name)


def has_strings(message: Descriptor, seen: frozenset[str] = frozenset()) -> bool:
    """Whether a message of this type can hold a string anywhere (recursive types end at `seen`)."""
    if message.full_name in seen:
        return False
    for field in message.fields:
        if field.type == FieldDescriptor.TYPE_STRING:
            return True
        if field.type == FieldDescriptor.TYPE_MESSAGE and has_strings(
            field.message_type, seen | {message.full_name}
        ):
            return True
    return False


WITH_STRINGS = [rpc for rpc in RPCS if has_strings(request_type(rpc))]


def test_every_rpc_whose_request_holds_a_string_gets_hostile_strings() -> None:
    # The rest take no string at all: their hostile input is the capability (test_fuzz_capabilities).
    assert {rpc.method for rpc in RPCS} - {rpc.method for rpc in WITH_STRINGS} == {
        "VerifyCapability",
        "ForgetAll",
        "RotateDatabaseCredentials",
        "GetCredentialStatus",
        "ReloadTrustBundle",
    }


async def hostile_string_in_any_field(
    fuzz: Target, tally: collections.Counter[str], rpc: Rpc, data: st.DataObject
) -> None:
    drawn = rpc.draw(data, fuzz)
    messages, path = data.draw(poisoned(drawn if rpc.stream else [drawn]), label="poisoned")
    surrogate = any(carries_surrogate_mark(message) for message in messages)
    if surrogate:
        wire = [with_lone_surrogates(message) for message in messages]
        request = wire if rpc.stream else wire[0]
    else:
        request = messages if rpc.stream else messages[0]
    metadata = bearer(fuzz.token) if rpc.role == "launcher" else ()
    answer = await call(fuzz, rpc, request, metadata)
    tally[answer.code] += 1
    if surrogate and not rpc.stream:
        # Not UTF-8, so not a message of the request type: refused before any handler runs.
        assert (answer.code, answer.fields) == ("INVALID_ARGUMENT", ("request",)), f"{path}: {answer}"


each_rpc_with_strings = pytest.mark.parametrize("rpc", WITH_STRINGS, ids=lambda rpc: rpc.id)
test_a_hostile_string_in_any_field_gets_a_deliberate_status = each_rpc_with_strings(
    fuzzed(HOSTILE_EXAMPLES)(hostile_string_in_any_field)
)
test_many_hostile_strings_in_any_field_get_a_deliberate_status = pytest.mark.slow(
    each_rpc_with_strings(fuzzed(DEEP_EXAMPLES)(hostile_string_in_any_field))
)


PAGING = {
    "ListMemories": lambda: memory_pb2.ListMemoriesRequest(page_size=2),
    "ListKnowledgeBases": lambda: knowledge_pb2.ListKnowledgeBasesRequest(namespace=FUZZ_NS, page_size=2),
    "ListDocuments": lambda: knowledge_pb2.ListDocumentsRequest(
        namespace=FUZZ_NS, knowledge_base_ref=KB_A, page_size=2
    ),
    "ListAuditEvents": lambda: admin_pb2.ListAuditEventsRequest(page_size=2),
}


def forged_tokens(method: str, target: Target) -> st.SearchStrategy[str]:
    known = {
        "ListMemories": target.known.memory_page_token,
        "ListKnowledgeBases": target.known.kb_page_token,
        "ListDocuments": target.known.doc_page_token,
        "ListAuditEvents": target.known.audit_page_token,
    }[method]
    # Every kind of forgery for every paging RPC: a codec must refuse the others' shapes too.
    return st.one_of(page_tokens(known), memory_page_tokens(b""), text_page_tokens(), NUMBER_PAGE_TOKENS)


async def forged_page_token(
    fuzz: Target, tally: collections.Counter[str], method: str, data: st.DataObject
) -> None:
    rpc = rpc_named(method)
    request = PAGING[method]()
    request.page_token = data.draw(forged_tokens(method, fuzz), label="page_token")
    metadata = bearer(fuzz.token) if rpc.role == "launcher" else ()
    answer = await call(fuzz, rpc, request, metadata)
    tally[answer.code] += 1
    assert answer.code == "OK" or (answer.code, answer.fields) == ("INVALID_ARGUMENT", ("page_token",)), (
        f"{method} with page_token {request.page_token!r}: {answer}"
    )


each_paging_rpc = pytest.mark.parametrize("method", sorted(PAGING))
test_a_forged_page_token_gets_a_page_or_invalid_argument_naming_page_token = each_paging_rpc(
    fuzzed(TOKEN_EXAMPLES)(forged_page_token)
)
test_many_forged_page_tokens_get_a_page_or_invalid_argument_naming_page_token = pytest.mark.slow(
    each_paging_rpc(fuzzed(DEEP_EXAMPLES)(forged_page_token))
)
