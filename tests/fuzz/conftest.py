"""Fixtures of the fuzz tests: one live target for the whole package, and a per-test tally.

Nothing is shared between tests but the target: every test checks, when it ends, that the server
serves and nothing it must not touch changed (`assert_intact`), so each one passes or fails on
its own, alone or in any order. The status codes each test saw are repeated in the terminal
summary.
"""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from tests.fuzz.target import (
    AGENT,
    CANARY_USER,
    FUZZ_NS,
    KB_A,
    KB_B,
    MAX_UPLOAD,
    RUN,
    SENTINEL_NS,
    TIMEOUT,
    Known,
    Target,
    assert_intact,
    launcher_token,
    seed,
    seed_canaries,
    state_of,
)
from tests.support import SharedDatabase, mtls_channel, role_channel, service_settings
from tokensvc.app import Service
from tokensvc.auth.devpki import DevPaths, issue_client_certificate
from tokensvc.v1 import admin_pb2, admin_pb2_grpc, knowledge_pb2, knowledge_pb2_grpc

# What each fuzz test saw, for the terminal summary: (test id, status code counts, and the
# upload refusals the asyncio client misreported as INTERNAL, by the code the server sent).
_TALLIES: list[tuple[str, collections.Counter[str], collections.Counter[str]]] = []


@pytest.fixture(scope="package")
async def fuzz(
    database: SharedDatabase, dev: DevPaths, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Target]:
    state = tmp_path_factory.mktemp("fuzz")
    # No expired-memory sweep while fuzzing: it may delete other tenants' rows, legitimately.
    settings = service_settings(
        database, dev, state, knowledge_max_upload_bytes=MAX_UPLOAD, memory_sweep_interval_seconds=3600
    )
    service = Service(settings)
    await service.start()
    channels: dict[str, grpc.aio.Channel] = {}
    for name, namespace in (("launcher", FUZZ_NS), ("sentinel", SENTINEL_NS)):
        cert, key = issue_client_certificate(
            dev, f"spiffe://dev.local/ns/{namespace}/sa/{AGENT}", state / "certs", name=f"{name}-{RUN}"
        )
        channels[name] = mtls_channel(service.port, dev.ca_cert, cert, key)
    for role in ("control-plane", "admin"):
        channels[role] = role_channel(service.port, dev, role)
    token = launcher_token(dev, FUZZ_NS, kbs=[KB_A, KB_B, "kb-missing"])
    target = Target(service, database, channels, token, Known())
    try:
        # The sentinel: same agent name, user id and knowledge-base refs, in another namespace.
        sentinel_token = launcher_token(dev, SENTINEL_NS, kbs=[KB_A, KB_B])
        await seed(target, "sentinel", sentinel_token, SENTINEL_NS, tag="sentinel")
        await seed(target, "launcher", target.token, FUZZ_NS, tag="fuzz")
        target.canary_bucket = await seed_canaries(
            target, launcher_token(dev, FUZZ_NS, kbs=[], user=CANARY_USER)
        )
        control = knowledge_pb2_grpc.KnowledgeServiceStub(channels["control-plane"])
        bases = await control.ListKnowledgeBases(
            knowledge_pb2.ListKnowledgeBasesRequest(namespace=FUZZ_NS, page_size=1), timeout=TIMEOUT
        )
        target.known.kb_page_token = bases.next_page_token
        documents = await control.ListDocuments(
            knowledge_pb2.ListDocumentsRequest(namespace=FUZZ_NS, knowledge_base_ref=KB_A, page_size=1),
            timeout=TIMEOUT,
        )
        target.known.doc_page_token = documents.next_page_token
        admin = admin_pb2_grpc.AdminServiceStub(channels["admin"])
        events = await admin.ListAuditEvents(admin_pb2.ListAuditEventsRequest(page_size=1), timeout=TIMEOUT)
        target.known.audit_page_token = events.next_page_token
        target.baseline = await state_of(target)
        assert target.baseline["sentinel"], "the sentinel tenant has no rows"
        assert target.baseline["canary"], "the canaries have no rows"
        yield target
        await assert_intact(target)
    finally:
        for channel in channels.values():
            await channel.close(grace=None)
        await service.stop(grace=0)


@pytest.fixture
async def tally(fuzz: Target, request: pytest.FixtureRequest) -> AsyncIterator[collections.Counter[str]]:
    """A counter of the status codes this test's examples got. Afterwards: at least one example
    ran, the server still serves, and nothing the fuzzer must not touch has changed."""
    codes: collections.Counter[str] = collections.Counter()
    artifacts = fuzz.artifacts.copy()
    yield codes
    _TALLIES.append((request.node.nodeid.rpartition("::")[2], codes, fuzz.artifacts - artifacts))
    await assert_intact(fuzz)
    assert sum(codes.values()) > 0, "no example reached the server"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _TALLIES:
        return
    terminalreporter.section("fuzzed requests: status codes per test")
    total = sum(sum(codes.values()) for _, codes, _ in _TALLIES)
    terminalreporter.write_line(f"{total} generated requests in {len(_TALLIES)} tests")
    for name, codes, artifacts in _TALLIES:
        detail = ", ".join(f"{code} {n}" for code, n in codes.most_common())
        terminalreporter.write_line(f"  {name}: {sum(codes.values())} ({detail})")
        if artifacts:
            terminalreporter.write_line(
                f"    (grpc/grpc#36066: the asyncio client misreported {sum(artifacts.values())} upload "
                f"refusals as INTERNAL; the server had sent {dict(artifacts)})"
            )
