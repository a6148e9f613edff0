"""Background ingestion's job kind on the in-process stores: an upload queued PENDING, a runner's
turn making it READY batch by batch, an embedder that fails retried with backoff and then FAILED,
a refused document FAILED with its reason at once, a newer upload replacing a version mid-way,
and an upload that waits leaving the work to finish when its caller stops waiting.

The PostgreSQL store passes the same contract (tests/storage/conformance); the end-to-end paths,
SIGKILL included, are tests/api/test_knowledge_ingestion.py and test_ingestion_crashes.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence

import pytest

from tests.knowledge.test_knowledge_bases_unit import launcher
from tokensvc.audit import AuditLog
from tokensvc.embedders import EmbedderRegistry, EmbedderSpec, HashEmbedder, Vectors
from tokensvc.errors import EmbedderUnavailable, InvalidArgument, NotFound
from tokensvc.knowledge import (
    ChunkingKind,
    ChunkingStrategy,
    ExtractionPool,
    IngestionRunner,
    IngestionSettings,
)
from tokensvc.knowledge.service import KnowledgeBases
from tokensvc.retrieval import SearchMode
from tokensvc.storage.ingestion_records import IngestionQueue
from tokensvc.storage.inprocess import InProcessAuditStore, InProcessIngestionStore, InProcessKnowledgeStore
from tokensvc.storage.records import DocumentState

NS = "team-a"
ACTOR = "spiffe://dev.local/ns/control/sa/plane"
# Sixteen words a chunk: the text below is 10 chunks.
FIXED = ChunkingStrategy(ChunkingKind.FIXED, chunk_size=16, chunk_overlap=0)
TEXT = " ".join(f"word{i}" for i in range(160)).encode()


class ScriptedEmbedder:
    """The hash embedder, failing the first `failures` calls and then, when `gate` is set,
    waiting for it before each call; it counts the texts it embedded."""

    def __init__(self, failures: int = 0) -> None:
        self._inner = HashEmbedder("hash", 64)
        self.failures = failures
        self.calls = 0
        self.embedded = 0
        self.gate: asyncio.Event | None = None
        self.entered = asyncio.Event()

    @property
    def spec(self) -> EmbedderSpec:
        return self._inner.spec

    async def embed_documents(self, texts: Sequence[str]) -> Vectors:
        self.calls += 1
        self.entered.set()
        if self.failures:
            self.failures -= 1
            raise EmbedderUnavailable("the embedding server answered 503")
        if self.gate is not None:
            await self.gate.wait()
        self.embedded += len(texts)
        return await self._inner.embed_documents(texts)

    async def embed_query(self, text: str) -> Vectors:
        return await self._inner.embed_query(text)

    async def aclose(self) -> None:
        return None


@pytest.fixture(scope="module")
def extraction() -> Iterator[ExtractionPool]:
    pool = ExtractionPool(workers=1, limit_seconds=30, memory_bytes=1024**3)
    yield pool
    pool.close()


class Setup:
    def __init__(self, extraction: ExtractionPool, embedder: ScriptedEmbedder, **settings: float) -> None:
        self.embedder = embedder
        self.store = InProcessKnowledgeStore()
        self.ingestions = InProcessIngestionStore(self.store)
        registry = EmbedderRegistry({"hash": embedder})
        self.runner = IngestionRunner(
            self.ingestions,
            registry,
            extraction,
            IngestionSettings(batch_size=4, backoff_seconds=0.001, max_backoff_seconds=0.002, **settings),  # type: ignore[arg-type]
        )
        self.kbs = KnowledgeBases(
            self.store,
            registry,
            audit=AuditLog(InProcessAuditStore()),
            ingestions=self.ingestions,
            ingestion=self.runner,
            default_embedder="hash",
        )

    async def base(self) -> None:
        await self.kbs.create(NS, "kb", "", "hash", FIXED, actor=ACTOR)

    async def upload(self, content: bytes, *, content_type: str = "text/plain", wait: bool = False) -> int:
        result = await self.kbs.upload(NS, "kb", "doc", content_type, {}, content, wait=wait)
        return result.document.version

    async def document(self) -> tuple[DocumentState, int, int | None, int, int | None, str]:
        d = await self.kbs.get_document(NS, "kb", "doc")
        return d.state, d.version, d.chunks_done, d.chunk_count, d.searchable_version, d.failure_reason


async def test_a_queued_upload_is_ingested_by_a_runners_turn(extraction: ExtractionPool) -> None:
    setup = Setup(extraction, ScriptedEmbedder())
    await setup.base()
    assert await setup.upload(TEXT) == 1
    assert await setup.document() == (DocumentState.PENDING, 1, 0, 0, None, "")
    assert setup.embedder.embedded == 0  # nothing embedded in the upload's call

    assert await setup.runner.step()
    assert await setup.document() == (DocumentState.READY, 1, 10, 10, 1, "")
    # Each chunk embedded once, in batches of the configured size (4, 4, 2).
    assert (setup.embedder.embedded, setup.embedder.calls) == (10, 3)
    assert not await setup.runner.step()  # nothing left


async def test_progress_is_committed_batch_by_batch(extraction: ExtractionPool) -> None:
    embedder = ScriptedEmbedder()
    embedder.gate = asyncio.Event()
    setup = Setup(extraction, embedder)
    await setup.base()
    await setup.upload(TEXT)
    turn = asyncio.create_task(setup.runner.step())
    seen = set()
    while not turn.done():
        state = await setup.document()
        seen.add((state[0], state[2]))
        embedder.gate.set()
        await asyncio.sleep(0)
        embedder.gate.clear()
        embedder.entered.clear()
        await asyncio.wait(
            {turn, asyncio.create_task(embedder.entered.wait())}, return_when="FIRST_COMPLETED"
        )
    embedder.gate.set()
    await turn
    processing = sorted(done for state, done in seen if state is DocumentState.PROCESSING)
    assert set(processing) <= {0, 4, 8}
    assert len(processing) >= 2
    assert (await setup.document())[0] is DocumentState.READY


async def test_an_embedder_that_fails_is_retried_then_the_version_fails_and_the_previous_one_serves(
    extraction: ExtractionPool,
) -> None:
    setup = Setup(extraction, ScriptedEmbedder(), pause_after=3)
    await setup.base()
    await setup.upload(b"the first version of the document", wait=True)
    setup.embedder.failures = 2  # two failures, then it works: READY
    await setup.upload(TEXT)
    assert await setup.runner.step()
    assert (await setup.document())[:2] == (DocumentState.READY, 2)

    setup.embedder.failures = 10  # it keeps failing: FAILED after 3 in a row
    calls = setup.embedder.calls
    await setup.upload(b"a third version nobody will see")
    assert await setup.runner.step()
    state, version, _, _, searchable, reason = await setup.document()
    assert (state, version, searchable) == (DocumentState.FAILED, 3, 2)
    assert reason == "the embedding server answered 503"
    assert setup.embedder.calls - calls == 3
    passages = await setup.kbs.search(
        launcher("kb"), [], query="word1", top_k=3, min_score=None, filter_=None, mode=SearchMode.TEXT
    )
    assert {p.version for p in passages} == {2}


async def test_a_refused_document_fails_at_once_with_its_reason(extraction: ExtractionPool) -> None:
    setup = Setup(extraction, ScriptedEmbedder())
    await setup.base()
    await setup.upload(b"%PDF-1.7 not really", content_type="application/pdf")
    assert await setup.runner.step()
    state, _, _, _, searchable, reason = await setup.document()
    assert (state, searchable) == (DocumentState.FAILED, None)
    assert reason
    assert setup.embedder.calls == 0
    # An upload that waits is told why, naming the field, and keeps nothing (it replaced the
    # failed version, so the document is gone).
    with pytest.raises(InvalidArgument) as refused:
        await setup.upload(b"%PDF-1.7 still not", content_type="application/pdf", wait=True)
    assert refused.value.field == "content"
    assert await setup.ingestions.queue() == IngestionQueue(0, 0, 0, 0.0)
    with pytest.raises(NotFound):
        await setup.document()


async def test_a_newer_upload_replaces_a_version_mid_way(extraction: ExtractionPool) -> None:
    embedder = ScriptedEmbedder()
    embedder.gate = asyncio.Event()
    setup = Setup(extraction, embedder)
    await setup.base()
    await setup.upload(TEXT)
    turn = asyncio.create_task(setup.runner.step())
    await embedder.entered.wait()  # the first batch is being embedded
    assert await setup.upload(b"the replacement, short") == 2
    embedder.gate.set()
    await turn  # its next write is refused: the lease went with the replaced version
    assert (await setup.document())[:2] == (DocumentState.PENDING, 2)
    assert await setup.runner.step()
    assert await setup.document() == (DocumentState.READY, 2, 1, 1, 2, "")


async def test_an_upload_that_stops_waiting_leaves_the_work_to_finish(extraction: ExtractionPool) -> None:
    embedder = ScriptedEmbedder()
    embedder.gate = asyncio.Event()
    setup = Setup(extraction, embedder)
    await setup.base()
    waiting = asyncio.create_task(setup.upload(TEXT, wait=True))
    await embedder.entered.wait()
    waiting.cancel()  # the caller's deadline
    with pytest.raises(asyncio.CancelledError):
        await waiting
    embedder.gate.set()
    for _ in range(200):
        if (await setup.document())[0] is DocumentState.READY:
            break
        await asyncio.sleep(0.01)
    assert await setup.document() == (DocumentState.READY, 1, 10, 10, 1, "")
    await setup.runner.close()
