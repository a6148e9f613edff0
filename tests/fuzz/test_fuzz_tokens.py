"""Every opaque token tokensvc decodes from JSON, fed deeply nested and oversized JSON over the
live server (issue 35): the page tokens of every List RPC that takes JSON ones, ExportEndUser's
resume token, and a capability's header and payload (validly signed). A token is refused
deliberately and says which field (INVALID_ARGUMENT naming it; a capability UNAUTHENTICATED,
CAPABILITY_INVALID), never INTERNAL."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import strategies as st

from tests.fuzz.strategies import HOSTILE_JSON, HOSTILE_JSON_TOKENS, fuzzed
from tests.fuzz.target import FUZZ_NS, KB_A, SPARE_NS, Target, send
from tests.support import Signer, bearer, launcher_claims, segment
from tokensvc.auth.devpki import DevPaths
from tokensvc.v1 import (
    capability_pb2,
    data_subject_pb2,
    knowledge_pb2,
    memory_pb2,
    migration_pb2,
)

EXAMPLES = 40  # per token
# gRPC itself refuses metadata past 32 KiB, before tokensvc sees the call: a capability that long
# tests the transport, not the verifier (whose own bound is 8 KiB).
CAPABILITY_SIZED = HOSTILE_JSON.filter(lambda document: len(document) < 20_000)


def _launcher(target: Target) -> tuple[tuple[str, str], ...]:
    return bearer(target.token)


def _none(target: Target) -> tuple[tuple[str, str], ...]:
    return ()


# (service, method, role, the field, request with that token, whose metadata, streams its answer)
TOKENS: list[tuple[str, str, str, str, Callable[[str], Any], Callable[[Target], Any], bool]] = [
    (
        "MemoryService",
        "ListMemories",
        "launcher",
        "page_token",
        lambda t: memory_pb2.ListMemoriesRequest(page_token=t),
        _launcher,
        False,
    ),
    (
        "KnowledgeService",
        "ListKnowledgeBases",
        "control-plane",
        "page_token",
        lambda t: knowledge_pb2.ListKnowledgeBasesRequest(namespace=FUZZ_NS, page_token=t),
        _none,
        False,
    ),
    (
        "KnowledgeService",
        "ListDocuments",
        "admin",
        "page_token",
        lambda t: knowledge_pb2.ListDocumentsRequest(
            namespace=FUZZ_NS, knowledge_base_ref=KB_A, page_token=t
        ),
        _none,
        False,
    ),
    (
        "MigrationService",
        "ListEmbeddingMigrations",
        "control-plane",
        "page_token",
        lambda t: migration_pb2.ListEmbeddingMigrationsRequest(page_token=t),
        _none,
        False,
    ),
    (
        "DataSubjectService",
        "ExportEndUser",
        "control-plane",
        "resume_token",
        # The fuzzer's spare namespace: empty, so a token that passed would export nothing.
        lambda t: data_subject_pb2.ExportEndUserRequest(namespace=SPARE_NS, user_id="u", resume_token=t),
        _none,
        True,
    ),
]


@pytest.mark.parametrize(
    ("service", "method", "role", "field", "build", "metadata", "streams"),
    TOKENS,
    ids=[f"{method}.{field}" for _, method, _, field, *_ in TOKENS],
)
@fuzzed(EXAMPLES)
async def test_a_deeply_nested_or_oversized_token_is_invalid_argument_naming_its_field(
    fuzz: Target,
    tally: collections.Counter[str],
    service: str,
    method: str,
    role: str,
    field: str,
    build: Callable[[str], Any],
    metadata: Callable[[Target], Any],
    streams: bool,
    data: st.DataObject,
) -> None:
    token = data.draw(HOSTILE_JSON_TOKENS, label="token")
    answer = await send(
        fuzz, service, method, build(token), metadata(fuzz), role=role, response_stream=streams
    )
    tally[answer.code] += 1
    assert answer.code == "INVALID_ARGUMENT", answer
    assert field in answer.fields, answer


@pytest.mark.parametrize("where", ["header", "payload"])
@fuzzed(EXAMPLES)
async def test_a_signed_capability_of_deeply_nested_or_oversized_json_is_unauthenticated(
    fuzz: Target, dev: DevPaths, tally: collections.Counter[str], where: str, data: st.DataObject
) -> None:
    signer = Signer.dev(dev)
    hostile = data.draw(CAPABILITY_SIZED, label=where)
    if where == "header":
        token = signer.sign_segments(segment(hostile), segment(launcher_claims(ns=FUZZ_NS)))
    else:
        token = signer.sign_segments(segment(signer.header()), segment(hostile))
    request = capability_pb2.VerifyCapabilityRequest()
    answer = await send(
        fuzz, "CapabilityService", "VerifyCapability", request, bearer(token), role="launcher"
    )
    tally[answer.code] += 1
    assert (answer.code, answer.reason) == ("UNAUTHENTICATED", "CAPABILITY_INVALID"), answer
