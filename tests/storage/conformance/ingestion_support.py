"""Helpers of the ingestion conformance tests: uploads, extractions, and a runner's steps.

PostgreSQL's queue is every namespace's, and its database is shared by the session: a claim may
hand out another test's ingestion, so `claim_ours` skips those (naming them busy), and the
`kb_namespace` fixture (conftest.py) deletes its bases, with their ingestions, when the test ends.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from tests.storage.conformance.support import (
    DIM,
    axis,
    management,
    sha,
    vector_query,
)
from tokensvc.storage.filter_language import Filter
from tokensvc.storage.ingestion_records import Enqueued, Extracted, Ingestion, StagedChunk
from tokensvc.storage.ports import IngestionStore, KnowledgeStore
from tokensvc.storage.records import DocumentRow, Location, SourceSpan, Tenant

LEASE = 30.0


def new_runner() -> str:
    return f"runner-{uuid.uuid4().hex[:12]}"


async def enqueue(
    store: IngestionStore,
    ns: str,
    ref: str,
    body: str,
    *,
    kb_ref: str = "kb",
    metadata: dict[str, Any] | None = None,
    tenant: Tenant | None = None,
) -> Enqueued | None:
    content = body.encode()
    return await store.enqueue(
        tenant or management(ns),
        kb_ref=kb_ref,
        ref=ref,
        content_type="text/plain",
        content_sha256=sha(body),
        size_bytes=len(content),
        metadata=metadata or {},
        content=content,
    )


async def queued(store: IngestionStore, ns: str, ref: str, body: str, **options: Any) -> Ingestion:
    """Enqueue `body` as the next version; its ingestion."""
    enqueued = await enqueue(store, ns, ref, body, **options)
    assert enqueued is not None
    assert enqueued.ingestion is not None
    return enqueued.ingestion


def staged(texts: Sequence[str]) -> list[StagedChunk]:
    out, offset = [], 0
    for i, text in enumerate(texts):
        out.append(
            StagedChunk(i, text, offset, offset + len(text), ("Title", f"Part {i}"), Location(i + 1, i + 1))
        )
        offset += len(text) + 1
    return out


def extraction(texts: Sequence[str], *, generation: int = 0) -> Extracted:
    text = "\n".join(texts)
    return Extracted(text, (SourceSpan(0, len(text), page=1),), "text/markdown", staged(texts), generation)


def vectors_of(chunks: Sequence[StagedChunk], dim: int = DIM) -> list[tuple[StagedChunk, np.ndarray]]:
    """Chunk i along axis i mod `dim`."""
    return [(c, axis(c.index % dim, dim)) for c in chunks]


async def leased(
    store: IngestionStore, job: Ingestion, runner: str, *, lease_seconds: float = LEASE
) -> Ingestion:
    claimed = await store.claim_one(job, runner, lease_seconds=lease_seconds)
    assert claimed is not None
    assert claimed.id == job.id
    return claimed


async def embed_all(store: IngestionStore, job: Ingestion, runner: str, *, dim: int = DIM) -> Ingestion:
    while chunks := await store.unembedded(job, runner, limit=2):
        stored = await store.store_vectors(job, runner, vectors_of(chunks, dim))
        assert stored is not None
        job = stored
    return job


async def ingest(
    store: IngestionStore, job: Ingestion, texts: Sequence[str], *, generation: int = 0, dim: int = DIM
) -> DocumentRow:
    """A runner's whole turn: claim, extract, embed, finish."""
    runner = new_runner()
    job = await leased(store, job, runner)
    extracted = await store.store_extraction(job, runner, extraction(texts, generation=generation))
    assert extracted is not None
    job = await embed_all(store, extracted, runner, dim=dim)
    document = await store.finish(job, runner)
    assert document is not None
    return document


async def ready(
    store: IngestionStore, ns: str, ref: str, texts: Sequence[str], **options: Any
) -> DocumentRow:
    """A READY version of `ref` made of `texts`, through the queue."""
    return await ingest(store, await queued(store, ns, ref, "\n".join(texts), **options), texts)


async def claim_ours(
    store: IngestionStore,
    runner: str,
    ours: Collection[str],
    *,
    busy: Collection[str] = (),
    lease_seconds: float = LEASE,
) -> Ingestion | None:
    """Claim until one of `ours` (ids) is claimed; None when the queue has no other for `runner`.
    Others' ingestions claimed meanwhile (PostgreSQL's queue is shared) are named busy after."""
    skipped = set(busy)
    for _ in range(2000):
        claimed = await store.claim(runner, lease_seconds=lease_seconds, busy=skipped)
        if claimed is None or claimed.id in ours:
            return claimed
        skipped.add(claimed.id)
    raise AssertionError("the queue never ran dry")


async def searchable_texts(
    knowledge: KnowledgeStore,
    ns: str,
    *,
    generation: int = 0,
    dim: int = DIM,
    filter_: Filter | None = None,
) -> set[tuple[str, int, str]]:
    """Every chunk a search of "kb" finds: (document, version, text)."""
    outcome = await knowledge.search(
        management(ns),
        ["kb"],
        lambda _rows: vector_query(axis(0, dim), k=1000),
        row_count=1000,
        count_cap=1,
        filter_=filter_,
        generations=[generation],
    )
    return {(c.item.doc_ref, c.item.version, c.item.text) for c in outcome.candidates}
