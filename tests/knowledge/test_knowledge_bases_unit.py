"""KnowledgeBases' business rules on the in-process stores: no database, the `hash` embedder.

The store contract is the conformance suite's (tests/storage/conformance); these pin what the
domain adds: pinned choices, audited management, upload as unchanged / metadata-only / new
version (embedding only when the content changed; an upload that waits for its version here), roster enforcement that names no other
corpus, and search modes, top_k, min_score and filters over passages with citations.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

from tests.retrieval.engine_support import RecordingEngine
from tokensvc.audit import AuditKind, AuditLog
from tokensvc.auth.scope import TenantScope
from tokensvc.embedders import EmbedderRegistry, EmbedderSpec, HashEmbedder, Vectors
from tokensvc.errors import InvalidArgument, NotFound, PermissionDenied, PinnedConfiguration
from tokensvc.knowledge import ChunkingKind, ChunkingStrategy, ExtractionPool, IngestionRunner
from tokensvc.knowledge.service import KnowledgeBases, UploadResult
from tokensvc.memory import Condition, Operator
from tokensvc.retrieval import SearchMode
from tokensvc.storage.inprocess import InProcessAuditStore, InProcessIngestionStore, InProcessKnowledgeStore

NS = "team-a"
ACTOR = "spiffe://dev.local/ns/control/sa/plane"
FIXED = ChunkingStrategy(ChunkingKind.FIXED, chunk_size=16, chunk_overlap=0)
HANDBOOK = (
    b"Deployments roll out in canary waves and pause on a rising error rate. "
    b"Rollbacks restore the previous release within five minutes of a failed canary. "
    b"On call engineers page the database team when replication lag exceeds a minute. "
    b"Backups are verified every night by restoring them into a scratch cluster."
)


class CountingEmbedder:
    """The hash embedder, counting the texts it embeds for documents."""

    def __init__(self, name: str = "hash", dimension: int = 384) -> None:
        self._inner = HashEmbedder(name, dimension)
        self.embedded = 0

    @property
    def spec(self) -> EmbedderSpec:
        return self._inner.spec

    async def embed_documents(self, texts: Sequence[str]) -> Vectors:
        self.embedded += len(texts)
        return await self._inner.embed_documents(texts)

    async def embed_query(self, text: str) -> Vectors:
        return await self._inner.embed_query(text)

    async def aclose(self) -> None:
        return None


def launcher(*roster: str) -> TenantScope:
    return TenantScope(
        namespace=NS,
        agent="reader",
        bucket_id="v1.aaaa",
        previous_bucket_ids=(),
        agent_bucket_id="v1.aaaa",
        per_user=False,
        registry=None,
        long_term_memory=False,
        knowledge_bases=roster,
        run_id="run-1",
        jti="jti-1",
        issued_at=0,
        expires_at=0,
    )


@pytest.fixture
def embedder() -> CountingEmbedder:
    return CountingEmbedder()


@pytest.fixture
def audit_store() -> InProcessAuditStore:
    return InProcessAuditStore()


@pytest.fixture
def store() -> InProcessKnowledgeStore:
    return InProcessKnowledgeStore()


@pytest.fixture(scope="module")
def extraction() -> Iterator[ExtractionPool]:
    pool = ExtractionPool(workers=1, limit_seconds=30, memory_bytes=1024**3)
    yield pool
    pool.close()


@pytest.fixture
def engine() -> RecordingEngine:
    return RecordingEngine()


@pytest.fixture
def kbs(
    store: InProcessKnowledgeStore,
    embedder: CountingEmbedder,
    audit_store: InProcessAuditStore,
    extraction: ExtractionPool,
    engine: RecordingEngine,
) -> KnowledgeBases:
    registry = EmbedderRegistry({"hash": embedder, "small": CountingEmbedder("small", 64)})
    ingestions = InProcessIngestionStore(store)
    return KnowledgeBases(
        store,
        registry,
        audit=AuditLog(audit_store),
        ingestions=ingestions,
        ingestion=IngestionRunner(ingestions, registry, extraction),
        default_embedder="hash",
        engine=engine,
    )


async def audited(audit_store: InProcessAuditStore, kind: AuditKind) -> list[tuple[str, str]]:
    events = await audit_store.page(before_id=None, kinds=[kind.value], since=None, until=None, limit=100)
    return [(event.target, event.detail) for event in reversed(events)]


async def upload(
    kbs: KnowledgeBases, doc: str, content: bytes, kb: str = "handbook", **metadata: str | float | bool
) -> UploadResult:
    """An upload that waits until its version is searchable (these tests search right after)."""
    return await kbs.upload(NS, kb, doc, "text/plain", dict(metadata), content, wait=True)


# --- management -------------------------------------------------------------------------------


async def test_create_pins_the_choices_audits_once_and_refuses_a_change(
    kbs: KnowledgeBases, audit_store: InProcessAuditStore
) -> None:
    base, created = await kbs.create(NS, "handbook", "The handbook", "", FIXED, actor=ACTOR)
    assert created
    assert (base.embedder, base.dimension, base.chunking, base.chunk_size, base.text_config) == (
        "hash",
        384,
        "fixed",
        16,
        "english",
    )

    again, created_again = await kbs.create(NS, "handbook", "Renamed", "hash", FIXED, actor=ACTOR)
    assert (again, created_again) == (base, False), "an empty text config keeps the pinned one"
    for embedder, chunking, config in (
        ("small", FIXED, ""),
        ("hash", ChunkingStrategy(ChunkingKind.MARKDOWN, 16, 0), ""),
        ("hash", ChunkingStrategy(ChunkingKind.FIXED, 32, 0), ""),
        ("hash", FIXED, "simple"),
    ):
        with pytest.raises(PinnedConfiguration):
            await kbs.create(NS, "handbook", "", embedder, chunking, text_config=config, actor=ACTOR)

    assert await audited(audit_store, AuditKind.KNOWLEDGE_BASE_CREATION) == [
        (f"{NS}/handbook", "embedder hash, fixed chunking")
    ]


async def test_create_refuses_an_unknown_embedder_or_text_config_naming_the_field(
    kbs: KnowledgeBases,
) -> None:
    with pytest.raises(InvalidArgument) as embedder:
        await kbs.create(NS, "kb", "", "missing", FIXED, actor=ACTOR)
    with pytest.raises(InvalidArgument) as config:
        await kbs.create(NS, "kb", "", "hash", FIXED, text_config="klingon", actor=ACTOR)

    assert (embedder.value.field, config.value.field) == ("embedder", "text_search_config")
    assert await kbs.list_bases(NS, after=None, limit=10) == []


async def test_delete_is_audited_with_its_document_count_and_a_missing_base_is_not_found(
    kbs: KnowledgeBases, audit_store: InProcessAuditStore
) -> None:
    await kbs.create(NS, "handbook", "", "", FIXED, actor=ACTOR)
    await upload(kbs, "a", b"first document")
    await upload(kbs, "b", b"second document")

    assert await kbs.delete(NS, "handbook", actor=ACTOR) == 2
    with pytest.raises(NotFound):
        await kbs.delete(NS, "handbook", actor=ACTOR)
    with pytest.raises(NotFound):
        await kbs.get(NS, "handbook")
    assert await audited(audit_store, AuditKind.KNOWLEDGE_BASE_DELETION) == [
        (f"{NS}/handbook", "2 documents")
    ]


# --- uploads ----------------------------------------------------------------------------------


async def test_upload_writes_a_version_and_identical_bytes_are_unchanged_without_embedding(
    kbs: KnowledgeBases, embedder: CountingEmbedder
) -> None:
    await kbs.create(NS, "handbook", "", "", FIXED, actor=ACTOR)

    first = await upload(kbs, "ops", HANDBOOK, team="ops")
    embedded = embedder.embedded
    same = await upload(kbs, "ops", HANDBOOK, team="ops")
    relabelled = await upload(kbs, "ops", HANDBOOK, team="sre")

    assert (first.unchanged, first.document.version) == (False, 1)
    assert first.document.chunk_count == embedded > 1, "one embedding per chunk"
    assert (same.unchanged, same.document) == (True, first.document)
    assert (relabelled.unchanged, relabelled.document.version, relabelled.document.metadata) == (
        True,
        1,
        {"team": "sre"},
    )
    assert embedder.embedded == embedded, "unchanged bytes are never chunked or embedded again"
    assert (await kbs.get_document(NS, "handbook", "ops")).metadata == {"team": "sre"}


async def test_new_bytes_write_the_next_version(kbs: KnowledgeBases, embedder: CountingEmbedder) -> None:
    await kbs.create(NS, "handbook", "", "", FIXED, actor=ACTOR)
    await upload(kbs, "ops", HANDBOOK)

    second = await upload(kbs, "ops", b"A much shorter handbook now.")

    assert (second.unchanged, second.document.version, second.document.chunk_count) == (False, 2, 1)
    passages = await kbs.search(
        launcher("handbook"),
        [],
        query="handbook",
        top_k=10,
        min_score=None,
        filter_=None,
        mode=SearchMode.TEXT,
    )
    assert [(p.citation, p.version) for p in passages] == [("ops#0", 2)]


async def test_uploads_to_a_missing_base_and_reads_of_missing_documents_are_not_found(
    kbs: KnowledgeBases,
) -> None:
    with pytest.raises(NotFound):
        await upload(kbs, "ops", HANDBOOK, kb="missing")
    await kbs.create(NS, "handbook", "", "", FIXED, actor=ACTOR)
    for call in (
        kbs.get_document(NS, "handbook", "absent"),
        kbs.delete_document(NS, "handbook", "absent"),
        kbs.list_documents(NS, "missing", after=None, limit=10, filter_=None),
    ):
        with pytest.raises(NotFound):
            await call


async def test_documents_list_in_ref_order_with_filters_and_delete_counts_chunks(kbs: KnowledgeBases) -> None:
    await kbs.create(NS, "handbook", "", "", FIXED, actor=ACTOR)
    for ref, team in (("c", "ops"), ("a", "sre"), ("b", "ops")):
        await upload(kbs, ref, HANDBOOK + ref.encode(), team=team)

    listed = await kbs.list_documents(NS, "handbook", after=None, limit=10, filter_=None)
    ops = await kbs.list_documents(
        NS, "handbook", after="b", limit=10, filter_=Condition("team", Operator.EQ, "ops")
    )

    assert [d.ref for d in listed] == ["a", "b", "c"]
    assert [d.ref for d in ops] == ["c"]
    assert await kbs.delete_document(NS, "handbook", "a") == listed[0].chunk_count
    assert (await kbs.get(NS, "handbook")).document_count == 2


# --- search -----------------------------------------------------------------------------------


@pytest.fixture
async def corpus(kbs: KnowledgeBases) -> KnowledgeBases:
    await kbs.create(NS, "handbook", "", "", FIXED, actor=ACTOR)
    await kbs.create(NS, "secret", "", "", FIXED, actor=ACTOR)
    await upload(kbs, "ops", HANDBOOK, team="ops")
    await upload(kbs, "plans", b"The secret launch plan is kept here.", kb="secret")
    return kbs


async def test_a_launcher_searches_only_its_roster_and_a_refusal_names_a_position_not_a_ref(
    corpus: KnowledgeBases,
) -> None:
    reader = launcher("handbook", "unknown-kb")

    with pytest.raises(PermissionDenied) as refused:
        await corpus.search(
            reader,
            ["handbook", "secret"],
            query="secret plan",
            top_k=5,
            min_score=None,
            filter_=None,
            mode=SearchMode.HYBRID,
        )
    assert refused.value.field == "knowledge_base_refs[1]"
    assert "secret" not in str(refused.value)
    with pytest.raises(PermissionDenied):
        await corpus.search(
            launcher(), [], query="x", top_k=5, min_score=None, filter_=None, mode=SearchMode.TEXT
        )
    with pytest.raises(InvalidArgument):
        await corpus.search(
            reader, ["handbook"] * 17, query="x", top_k=5, min_score=None, filter_=None, mode=SearchMode.TEXT
        )

    everything = await corpus.search(
        reader, [], query="secret plan canary", top_k=50, min_score=None, filter_=None, mode=SearchMode.HYBRID
    )
    assert everything
    assert {p.kb_ref for p in everything} == {"handbook"}, "the roster, whatever exists"


@pytest.mark.parametrize("mode", list(SearchMode))
async def test_search_returns_cited_passages_bounded_by_top_k_min_score_and_filter(
    corpus: KnowledgeBases, mode: SearchMode
) -> None:
    reader = launcher("handbook", "secret")
    question = "what happens after a failed canary"

    passages = await corpus.search(
        reader, ["handbook"], query=question, top_k=10, min_score=None, filter_=None, mode=mode
    )

    assert passages
    assert all(p.citation == f"{p.doc_ref}#{p.chunk_index}" and p.kb_ref == "handbook" for p in passages)
    assert [p.score for p in passages] == sorted((p.score for p in passages), reverse=True)
    assert any("canary" in p.text for p in passages[:2])
    assert HANDBOOK.decode()[passages[0].start : passages[0].end] == passages[0].text
    top = await corpus.search(
        reader, ["handbook"], query=question, top_k=1, min_score=None, filter_=None, mode=mode
    )
    assert [(p.citation, p.score) for p in top] == [(p.citation, p.score) for p in passages[:1]]
    floor = passages[-1].score + 1e-9
    kept = await corpus.search(
        reader, ["handbook"], query=question, top_k=10, min_score=floor, filter_=None, mode=mode
    )
    assert [p.citation for p in kept] == [p.citation for p in passages if p.score >= floor]
    assert (
        await corpus.search(
            reader,
            ["handbook"],
            query=question,
            top_k=10,
            min_score=None,
            filter_=Condition("team", Operator.EQ, "sre"),
            mode=mode,
        )
        == []
    )


async def test_bases_with_different_embedders_are_searched_separately_and_merged_by_score(
    kbs: KnowledgeBases, engine: RecordingEngine
) -> None:
    await kbs.create(NS, "big", "", "hash", FIXED, actor=ACTOR)
    await kbs.create(NS, "small", "", "small", FIXED, actor=ACTOR)
    await upload(kbs, "doc", b"Canary waves pause on errors.", kb="big")
    await upload(kbs, "doc", b"Canary releases need a rollback plan.", kb="small")

    passages = await kbs.search(
        launcher("big", "small"),
        [],
        query="canary",
        top_k=10,
        min_score=None,
        filter_=None,
        mode=SearchMode.VECTOR,
    )

    assert {p.kb_ref for p in passages} == {"big", "small"}
    assert [p.score for p in passages] == sorted((p.score for p in passages), reverse=True)
    # One retrieval per embedder, each through the engine: the passages are what they returned.
    assert sorted(asked.dimension for asked, _ in engine.searches) == [64, 384]
    returned = sorted((r.item.kb_ref, r.item.chunk_index, r.score) for _, rs in engine.searches for r in rs)
    assert sorted((p.kb_ref, p.chunk_index, p.score) for p in passages) == returned
