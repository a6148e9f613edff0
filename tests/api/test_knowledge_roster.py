"""SearchKnowledge's roster: an agent searches only the corpora its capability grants (`kbs`).

A refusal must not tell an agent whether a corpus it was not granted exists, nor name any other
corpus; the launcher may call no management RPC; and namespaces never see each other's corpora.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.api.knowledge_support import (
    AGENT,
    FIXED,
    HYBRID,
    NAMESPACE,
    VECTOR,
    Clients,
    Manager,
    failure,
    new_ref,
    open_clients,
    upload_stream,
)
from tests.support import RpcFailure
from tokensvc.app import Service
from tokensvc.auth.devpki import DevPaths, issue_client_certificate
from tokensvc.v1 import knowledge_pb2

DENIED = grpc.StatusCode.PERMISSION_DENIED


@pytest.fixture
async def clients(service: Service, dev: DevPaths) -> AsyncIterator[Clients]:
    async with open_clients(service, dev) as opened:
        yield opened


async def corpus(manager: Manager, *texts: str) -> str:
    """A fresh knowledge base holding one plain-text document per text."""
    kb = new_ref()
    await manager.create(kb, FIXED)
    for n, text in enumerate(texts):
        await manager.upload(kb, f"doc-{n}.txt", text, content_type="text/plain")
    return kb


def without_request_id(refusal: RpcFailure) -> tuple[Any, ...]:
    """Everything a caller learns from a refusal, except the per-call request id."""
    metadata = {key: value for key, value in refusal.metadata.items() if key != "request_id"}
    return refusal.code, refusal.message, refusal.reason, metadata, refusal.field_violations


async def test_an_ungranted_corpus_is_refused_identically_whether_it_exists_or_not(clients: Clients) -> None:
    manager = clients.manager()
    granted = await corpus(manager, "Granted corpus about the deploy pipeline.")
    existing = await corpus(manager, "Secret corpus about the deploy pipeline.")
    missing = new_ref()
    searcher = clients.searcher([granted])

    refusals = {}
    for name, ref in (("existing", existing), ("missing", missing)):
        for mode in (VECTOR, HYBRID):
            refusal = await failure(searcher.search("deploy pipeline", [granted, ref], mode=mode))
            assert (refusal.code, refusal.reason) == (DENIED, "SCOPE_NOT_GRANTED")
            assert refusal.field_violations == ["knowledge_base_refs[1]"]
            assert refusal.metadata["field"] == "knowledge_base_refs[1]"
            everything = f"{refusal.message} {refusal.metadata} {refusal.field_violations}"
            for ref_named in (granted, existing, missing):
                assert ref_named not in everything  # names no corpus, granted or not
            refusals[name] = without_request_id(refusal)
        first = await failure(searcher.search("deploy pipeline", [ref, granted]))
        assert first.field_violations == ["knowledge_base_refs[0]"]
    assert refusals["existing"] == refusals["missing"]

    # Granted, the same search succeeds and sees the granted corpus only.
    passages = await searcher.search("deploy pipeline", [granted], top_k=10)
    assert {p.knowledge_base_ref for p in passages} == {granted}
    assert {p.knowledge_base_ref for p in await searcher.search("deploy pipeline", top_k=10)} == {granted}


async def test_a_granted_ref_without_a_corpus_contributes_nothing(clients: Clients) -> None:
    manager = clients.manager()
    real = await corpus(manager, "Rollback runbook: pick the previous release.")
    ghost = new_ref()  # granted, but never created
    searcher = clients.searcher([real, ghost])
    assert await searcher.search("rollback release", [ghost]) == []
    both = await searcher.search("rollback release", [ghost, real], top_k=10)
    assert both
    assert {p.knowledge_base_ref for p in both} == {real}
    # Created later, under the granted ref, it becomes searchable with the same capability.
    await manager.create(ghost, FIXED)
    await manager.upload(ghost, "late.txt", "A rollback note added later.", content_type="text/plain")
    assert {p.knowledge_base_ref for p in await searcher.search("rollback", [ghost])} == {ghost}


async def test_no_refs_searches_the_whole_roster_and_an_empty_roster_nothing(clients: Clients) -> None:
    manager = clients.manager()
    first = await corpus(manager, "Escalation policy for the ingest service.")
    second = await corpus(manager, "Escalation contacts for the billing service.")
    outside = await corpus(manager, "Escalation rules nobody granted.")
    passages = await clients.searcher([first, second]).search("escalation service", top_k=20)
    assert {p.knowledge_base_ref for p in passages} == {first, second}

    empty = clients.searcher([])
    for refs in ([], [first], [outside]):
        refusal = await failure(empty.search("escalation", refs))
        assert (refusal.code, refusal.reason) == (DENIED, "SCOPE_NOT_GRANTED")
        assert outside not in refusal.message
        assert first not in refusal.message


def management_calls(stub: Any, kb: str) -> dict[str, Callable[..., Awaitable[Any]]]:
    """Every management RPC, called with a well-formed request for `kb`."""
    ns = NAMESPACE
    doc = {"namespace": ns, "knowledge_base_ref": kb, "document_ref": "doc-0.txt"}
    chunking = knowledge_pb2.ChunkingStrategy(kind=FIXED)
    return {
        "CreateKnowledgeBase": lambda **kw: stub.CreateKnowledgeBase(
            knowledge_pb2.CreateKnowledgeBaseRequest(namespace=ns, ref=new_ref(), chunking=chunking), **kw
        ),
        "GetKnowledgeBase": lambda **kw: stub.GetKnowledgeBase(
            knowledge_pb2.GetKnowledgeBaseRequest(namespace=ns, ref=kb), **kw
        ),
        "ListKnowledgeBases": lambda **kw: stub.ListKnowledgeBases(
            knowledge_pb2.ListKnowledgeBasesRequest(namespace=ns), **kw
        ),
        "DeleteKnowledgeBase": lambda **kw: stub.DeleteKnowledgeBase(
            knowledge_pb2.DeleteKnowledgeBaseRequest(namespace=ns, ref=kb), **kw
        ),
        "UploadDocument": lambda **kw: stub.UploadDocument(
            upload_stream(kb, "new.txt", b"hello", content_type="text/plain"), **kw
        ),
        "GetDocument": lambda **kw: stub.GetDocument(knowledge_pb2.GetDocumentRequest(**doc), **kw),
        "ListDocuments": lambda **kw: stub.ListDocuments(
            knowledge_pb2.ListDocumentsRequest(namespace=ns, knowledge_base_ref=kb), **kw
        ),
        "DeleteDocument": lambda **kw: stub.DeleteDocument(knowledge_pb2.DeleteDocumentRequest(**doc), **kw),
    }


async def test_the_launcher_cannot_call_any_management_rpc(clients: Clients) -> None:
    manager = clients.manager()
    kb = await corpus(manager, "Onboarding checklist.")
    searcher = clients.searcher([kb])  # a valid capability granting the corpus does not help
    calls = management_calls(searcher.stub, kb)
    assert len(calls) == len(knowledge_pb2.DESCRIPTOR.services_by_name["KnowledgeService"].methods) - 1
    for rpc, call in calls.items():
        for metadata in ((), searcher.metadata):
            refusal = await failure(call(metadata=metadata, timeout=10))
            assert (refusal.code, refusal.reason) == (DENIED, "ROLE_NOT_ALLOWED"), rpc
    # Nothing was changed: the corpus and its one document are still there.
    assert [d.ref for page in await manager.list_documents(kb, 10) for d in page] == ["doc-0.txt"]
    # And the control plane, in turn, cannot search.
    request = knowledge_pb2.SearchKnowledgeRequest(knowledge_base_refs=[kb], query_text="onboarding")
    refusal = await failure(manager.stub.SearchKnowledge(request, metadata=searcher.metadata, timeout=10))
    assert (refusal.code, refusal.reason) == (DENIED, "ROLE_NOT_ALLOWED")


async def test_corpora_of_another_namespace_are_invisible(
    clients: Clients, dev: DevPaths, tmp_path: Path
) -> None:
    ref = new_ref()
    default_manager, other_manager = clients.manager(), clients.manager(namespace="other")
    await default_manager.create(ref, FIXED)
    await default_manager.upload(
        ref, "a.txt", "Default namespace runbook about failover.", content_type="text/plain"
    )
    certificate = issue_client_certificate(dev, f"spiffe://dev.local/ns/other/sa/{AGENT}", tmp_path, "other")
    other = clients.searcher([ref], namespace="other", certificate=certificate)

    # The same ref in the other namespace's roster finds nothing of namespace `default`.
    for mode in (VECTOR, HYBRID):
        assert await other.search("failover runbook", [ref], mode=mode) == []
        assert await other.search("failover runbook", mode=mode) == []
    # Its own corpus under the same ref is found, and only that one.
    await other_manager.create(ref, FIXED)
    await other_manager.upload(
        ref, "b.txt", "Other namespace notes about failover.", content_type="text/plain"
    )
    found = await other.search("failover runbook", [ref], top_k=10)
    assert [p.document_ref for p in found] == ["b.txt"]
    mine = await clients.searcher([ref]).search("failover runbook", [ref], top_k=10)
    assert [p.document_ref for p in mine] == ["a.txt"]

    # A capability naming namespace `default` does not bind to the other namespace's launcher.
    impostor = clients.searcher([ref], certificate=certificate)
    refusal = await failure(impostor.search("failover", [ref]))
    assert (refusal.code, refusal.reason) == (DENIED, "BINDING_MISMATCH")


async def test_search_arguments_are_checked(clients: Clients) -> None:
    manager = clients.manager()
    kb = await corpus(manager, "Capacity planning for the storage tier.", "Storage quotas per namespace.")
    many = [f"{kb}.{n}" for n in range(17)]
    searcher = clients.searcher([kb, *many])
    bad: list[tuple[dict[str, Any], str]] = [
        ({"query": "   "}, "query_text"),
        ({"query": "x" * 8193}, "query_text"),
        ({"top_k": 101}, "top_k"),
        ({"top_k": -1}, "top_k"),
        ({"refs": many}, "knowledge_base_refs"),
        ({"refs": [kb, "Not_A_Ref"]}, "knowledge_base_refs[1]"),
        ({"mode": 7}, "mode"),
        ({"min_score": float("nan")}, "min_score"),
    ]
    for options, field in bad:
        arguments: dict[str, Any] = {"query": "storage", "refs": [kb], **options}
        refusal = await failure(searcher.search(arguments.pop("query"), arguments.pop("refs"), **arguments))
        assert (refusal.code, refusal.field_violations) == (grpc.StatusCode.INVALID_ARGUMENT, [field]), (
            options
        )
    assert await searcher.search("x " * 4096, [kb])  # exactly 8 KiB is allowed
    scores = [p.score for p in await searcher.search("storage tier", [kb], mode=VECTOR)]
    assert len(scores) == 2
    above = await searcher.search("storage tier", [kb], mode=VECTOR, min_score=(scores[0] + scores[1]) / 2)
    assert [p.score for p in above] == scores[:1]
