"""Helpers of the conformance suite: fresh tenants, rows, queries, and reference scores.

The reference scores are computed here from the formulas in the contracts (cosine = inner product
of unit vectors; BM25 as `tokensvc.storage.postgres.ranking` states it), independently of either
implementation, so "both agree with the reference" means "they agree with each other". Texts in
scored fixtures are lowercase ASCII words separated by spaces under the `simple` configuration,
where PostgreSQL's parser and the in-process tokeniser see the same terms.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import math
import os
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

import numpy as np
import pytest

from tests.storage.search_support import search_candidates
from tokensvc.retrieval import BM25_B, BM25_K1, SearchTuning, candidate_query, query_words
from tokensvc.storage.filter_language import Filter
from tokensvc.storage.ports import KnowledgeStore, MemoryStore
from tokensvc.storage.records import (
    ALL_KNOWLEDGE_BASES,
    BaseRow,
    Candidate,
    CandidateQuery,
    ChunkRow,
    DocumentRow,
    EmbedderSpec,
    MemoryRecord,
    MemorySpace,
    NewMemory,
    PassageRow,
    Tenant,
)

T = TypeVar("T")

DIM = 8
EMBEDDER = "test"
NAMESPACE = "conformance"
# `simple`: no stemming and no stop words, so both implementations see the same terms.
SPACE = MemorySpace(EmbedderSpec("test", "conformance-model", DIM, True), "simple")
# Approximate (HNSW) and exact scans must both give complete, exact results on small buckets.
EXACTNESS = (True, False)


# --- tenants ----------------------------------------------------------------------------------


def new_bucket(pepper_version: int = 1) -> str:
    return f"v{pepper_version}." + base64.b32encode(os.urandom(20)).decode().lower().rstrip("=")


def new_tenant(*buckets: str) -> Tenant:
    """A fresh agent (so a fresh memory space) with these buckets."""
    return Tenant(NAMESPACE, f"agent-{uuid.uuid4().hex[:12]}", buckets)


def new_namespace() -> str:
    return f"conf-{uuid.uuid4().hex[:12]}"


def management(namespace: str) -> Tenant:
    return Tenant(namespace, knowledge_bases=(ALL_KNOWLEDGE_BASES,))


def launcher(namespace: str, *roster: str) -> Tenant:
    return Tenant(namespace, "launcher", knowledge_bases=roster)


# --- vectors and rows -------------------------------------------------------------------------


def unit(vector: Sequence[float] | np.ndarray) -> np.ndarray:
    wide = np.asarray(vector, dtype=np.float64)
    return (wide / np.linalg.norm(wide)).astype(np.float32)


def axis(i: int, dim: int = DIM) -> np.ndarray:
    vector = np.zeros(dim, dtype=np.float32)
    vector[i] = 1.0
    return vector


def random_unit(rng: np.random.Generator, dim: int = DIM) -> np.ndarray:
    return unit(rng.standard_normal(dim))


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a.astype(np.float64), b.astype(np.float64)))


def sha(content: str) -> bytes:
    return hashlib.sha256(content.encode()).digest()


def memory(
    content: str,
    embedding: np.ndarray,
    *,
    metadata: dict[str, Any] | None = None,
    key: str | None = None,
    ttl: int | None = None,
) -> NewMemory:
    return NewMemory(
        id=str(uuid.uuid4()),
        content=content,
        content_sha256=sha(content),
        metadata=metadata or {},
        idempotency_key=key,
        ttl_seconds=ttl,
        embedding=embedding,
    )


def base_row(namespace: str, ref: str, *, dimension: int = DIM, text_config: str = "simple") -> BaseRow:
    return BaseRow(
        namespace=namespace,
        ref=ref,
        display_name=f"the {ref} corpus",
        embedder="test",
        model="conformance-model",
        dimension=dimension,
        normalized=True,
        chunking="fixed",
        chunk_size=64,
        chunk_overlap=0,
        text_config=text_config,
        created_at=datetime(2000, 1, 1, tzinfo=UTC),  # the store sets its own
    )


def chunk_rows(texts: Sequence[str], vectors: Sequence[np.ndarray] | None = None) -> list[ChunkRow]:
    out, offset = [], 0
    for i, text in enumerate(texts):
        vector = axis(i % DIM) if vectors is None else vectors[i]
        out.append(ChunkRow(i, text, offset, offset + len(text), ("Title", f"Part {i}"), vector))
        offset += len(text) + 1
    return out


# --- queries ----------------------------------------------------------------------------------


SCAN = SearchTuning(ef_search=40)


def vector_query(
    vector: np.ndarray, *, k: int, exact: bool = True, neighbours: bool = False, row_count: int = 0
) -> CandidateQuery:
    """A VECTOR query: the plain statement unless neighbours are asked for."""
    return candidate_query(
        vector=vector, text=None, k=k, rows=row_count, exact=exact, neighbours=neighbours, tuning=SCAN
    )


def text_query(
    text: str,
    *,
    k: int,
    row_count: int,
    vector: np.ndarray | None = None,
    exact: bool = True,
    neighbours: bool = False,
) -> CandidateQuery:
    """A TEXT query, or with a vector a HYBRID one, built the way the domain builds it."""
    return candidate_query(
        vector=vector, text=text, k=k, rows=row_count, exact=exact, neighbours=neighbours, tuning=SCAN
    )


def embedded_later(query: CandidateQuery) -> CandidateQuery:
    """`query` with its vector still being embedded: the store may rank by text meanwhile."""
    assert query.vector is not None
    pending: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
    pending.set_result(query.vector)
    return dataclasses.replace(query, vector=None, vector_later=pending)


def _same(got: Sequence[Candidate[T]], expected: Sequence[Candidate[T]]) -> None:
    """The same candidates with the same ranks, neighbours and scores (in any order: the order of
    a statement's rows means nothing, fusion sorts them). Scores agree to 1e-6: a small search
    read whole is ranked in Python (float64 cosines; pgvector's are float32)."""

    def shape(c: Candidate[T]) -> tuple[Any, ...]:
        keys = (c.previous_key, c.next_key, c.second_previous_key, c.second_next_key)
        present = tuple(n is None for n in (c.previous, c.next, c.second_previous, c.second_next))
        return (repr(c.item), c.vector_rank, c.text_rank, keys, present)

    def scores(c: Candidate[T]) -> list[float]:
        neighbours = (c.previous, c.next, c.second_previous, c.second_next)
        return [c.vector_score, c.text_score, *(score for n in neighbours for score in n or ())]

    assert sorted(map(shape, got)) == sorted(map(shape, expected))
    expected_scores = {shape(c): scores(c) for c in expected}
    for c in got:
        assert scores(c) == pytest.approx(expected_scores[shape(c)], abs=1e-6)


def _hybrid(query: CandidateQuery) -> bool:
    return query.vector is not None and query.text is not None


async def search(
    store: MemoryStore, tenant: Tenant, bucket: str, query: CandidateQuery, filter_: Filter | None = None
) -> list[Candidate[MemoryRecord]]:
    """The candidates of `query` with its row count given (no counting). A HYBRID query is also
    run with its vector pending (the text ranker runs first): the candidates must be the same."""
    found = await search_candidates(store, tenant, bucket, query, filter_=filter_, embedder=EMBEDDER)
    if _hybrid(query):
        later = embedded_later(query)
        _same(
            await search_candidates(store, tenant, bucket, later, filter_=filter_, embedder=EMBEDDER), found
        )
    return found


async def counted_rows(
    store: MemoryStore, tenant: Tenant, bucket: str, cap: int, filter_: Filter | None = None
) -> int:
    """The row count a search with no known count gives its plan (and returns)."""
    seen: list[int] = []

    def plan(rows: int) -> CandidateQuery:
        seen.append(rows)
        return text_query("count", k=1, row_count=rows)

    outcome = await store.search(
        tenant, bucket, plan, row_count=None, count_cap=cap, filter_=filter_, embedder=EMBEDDER
    )
    assert seen == [outcome.row_count], "the plan is asked once, with the count returned"
    return outcome.row_count


def by_item(candidates: Sequence[Candidate[T]], key: Any) -> dict[Any, Candidate[T]]:
    found = {key(c.item): c for c in candidates}
    assert len(found) == len(candidates), "a row is a candidate once"
    return found


# --- reference scores -------------------------------------------------------------------------


def reference_bm25(
    texts: Mapping[Any, str], query: str, *, row_count: int, k1: float = BM25_K1, b: float = BM25_B
) -> dict[Any, float]:
    """BM25 of each text sharing a word with `query`, straight from the formula in the docstring
    of `tokensvc.storage.postgres.ranking` (texts: space-separated lowercase words)."""
    words = set(query_words(query))
    bags = {key: Counter(text.split()) for key, text in texts.items()}
    matched = {key: bag for key, bag in bags.items() if words & bag.keys()}
    if not matched:
        return {}
    n = max(row_count, len(matched))
    avgdl = sum(len(bag) for bag in matched.values()) / len(matched)
    scores = {}
    for key, bag in matched.items():
        total = 0.0
        for word in words & bag.keys():
            df = sum(1 for other in matched.values() if word in other)
            idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
            tf = bag[word]
            total += idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * len(bag) / avgdl))
        scores[key] = total
    return scores


def reference_ideal(texts: Mapping[Any, str], query: str, *, row_count: int, k1: float = BM25_K1) -> float:
    """The BM25 score no text reaches for `query`: every query word (one no text holds too) with
    its idf over the matching texts, its frequency saturated (`k1 + 1`)."""
    words = set(query_words(query))
    bags = [Counter(text.split()) for text in texts.values()]
    matched = [bag for bag in bags if words & bag.keys()]
    n = max(row_count, len(matched))
    dfs = [sum(1 for bag in matched if word in bag) for word in words]
    return sum(math.log(1 + (n - df + 0.5) / (df + 0.5)) for df in dfs) * (k1 + 1)


def ranks(scores: Mapping[Any, float], k: int) -> dict[Any, int]:
    """1-based ranks of the top k by score, ties by key (what both rankers promise)."""
    ordered = sorted(scores, key=lambda key: (-scores[key], key))[:k]
    return {key: rank for rank, key in enumerate(ordered, 1)}


# --- knowledge bases ---------------------------------------------------------------------------


async def create_base(store: KnowledgeStore, namespace: str, ref: str, **choices: Any) -> BaseRow:
    created, _ = await store.create_base(management(namespace), base_row(namespace, ref, **choices))
    return created


async def upload(
    store: KnowledgeStore,
    namespace: str,
    kb_ref: str,
    ref: str,
    texts: Sequence[str] | None,
    *,
    content: str | None = None,
    metadata: dict[str, Any] | None = None,
    vectors: Sequence[np.ndarray] | None = None,
) -> tuple[DocumentRow, bool] | None:
    """Store `texts` as the chunks of a document whose bytes are `content` (default: the texts
    joined); `texts=None` is the metadata-only call."""
    body = content if content is not None else "\n".join(texts or ())
    return await store.replace_document(
        management(namespace),
        kb_ref=kb_ref,
        ref=ref,
        content_type="text/plain",
        content_sha256=sha(body),
        size_bytes=len(body.encode()),
        metadata=metadata or {},
        chunks=None if texts is None else chunk_rows(texts, vectors),
    )


async def search_chunks(
    store: KnowledgeStore,
    tenant: Tenant,
    refs: Sequence[str],
    query: CandidateQuery,
    filter_: Filter | None = None,
) -> list[Candidate[PassageRow]]:
    """As `search`, for chunks (a HYBRID query also with its vector pending, the same result)."""
    found = await _chunk_candidates(store, tenant, refs, query, filter_)
    if _hybrid(query):
        _same(await _chunk_candidates(store, tenant, refs, embedded_later(query), filter_), found)
    return found


async def _chunk_candidates(
    store: KnowledgeStore, tenant: Tenant, refs: Sequence[str], query: CandidateQuery, filter_: Filter | None
) -> list[Candidate[PassageRow]]:
    outcome = await store.search(
        tenant,
        refs,
        lambda _rows: query,
        row_count=query.row_count,
        count_cap=1,
        filter_=filter_,
        generations=[0] * len(refs),
    )
    assert outcome.row_count == query.row_count
    return outcome.candidates


async def counted_chunks(store: KnowledgeStore, tenant: Tenant, refs: Sequence[str], cap: int) -> int:
    seen: list[int] = []

    def plan(rows: int) -> CandidateQuery:
        seen.append(rows)
        return text_query("count", k=1, row_count=rows)

    outcome = await store.search(
        tenant, refs, plan, row_count=None, count_cap=cap, filter_=None, generations=[0] * len(refs)
    )
    assert seen == [outcome.row_count]
    return outcome.row_count


def citation(passage: PassageRow) -> tuple[str, str, int, int]:
    """A chunk's identity (and tie-break key within a namespace)."""
    return passage.kb_ref, passage.doc_ref, passage.version, passage.chunk_index


async def current_document(
    knowledge: KnowledgeStore, tenant: Tenant, kb_ref: str, ref: str
) -> DocumentRow | None:
    """The current version of a document, as `document_state` reads it."""
    return (await knowledge.document_state(tenant, kb_ref, ref))[1]
