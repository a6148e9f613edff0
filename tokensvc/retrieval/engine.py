"""The retrieval engine: one search of one corpus, planned, fetched and fused the same way for
memories and knowledge bases.

A service builds a `Retrieval` (the query, embedded with the corpus's pinned embedder by
`embed_query`, and what the corpus pins) and names how its store searches its corpus (`Fetch`);
`RetrievalEngine.search` does the rest: it hands the store a `RoutedPlan`, and fuses the
candidates that come back by the search's mode.

The plan is an object the store calls rather than a query built beforehand because routing needs
the searched rows' count, and that count is read inside the search's own transaction, from its
snapshot, when no recent count is known (one round trip, and BM25's N of the rows it ranks). A
caching decorator around the store (`tokensvc.storage.caching`) supplies recent counts; the engine
never holds one.

A HYBRID search by text ranks by text while its query is embedded: the plan carries the pending
vector (`CandidateQuery.vector_later`) and the store runs the text ranker in the search's
transaction, then the vector ranker and fusion in the same snapshot once the vector is there. On
two cores the embedding takes one (the model runs single-threaded per query), so the text ranker's
time, the transaction's start and the count come off the search's latency. It overlaps only when
no other query is waiting for the embedder: a search queued behind others would hold a pooled
connection idle for the whole wait, so under load the search embeds first, as before.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from opentelemetry import trace

from tokensvc.embedders import ScheduledEmbedder, WorkClass, fair_share
from tokensvc.observability.metrics import observe_embedding
from tokensvc.retrieval.fusion import FusionWeights, Ranked, SearchMode, apply_mode
from tokensvc.retrieval.planning import candidate_query
from tokensvc.retrieval.routing import SearchTuning
from tokensvc.retrieval.vectors import unit_vector
from tokensvc.storage.records import CandidateQuery, SearchOutcome

__all__ = ["Fetch", "QueryEmbedding", "Retrieval", "RetrievalEngine", "RoutedPlan", "embed_query"]

T = TypeVar("T")
_tracer = trace.get_tracer("tokensvc.retrieval")


@dataclass(frozen=True)
class QueryEmbedding:
    """A query's text still to be embedded: by the corpus's pinned embedder, in the query class,
    in the agent's fair share."""

    embedder: ScheduledEmbedder
    text: str
    namespace: str
    agent: str

    async def vector(self) -> np.ndarray:
        return await embed_query(self.embedder, self.text, self.namespace, self.agent)

    def unqueued(self) -> bool:
        """Whether no query waits for the embedder (this one is next)."""
        return self.embedder.scheduler.queued_texts(WorkClass.QUERY) == 0


@dataclass(frozen=True)
class Retrieval:
    """One search of one corpus: a bucket, or knowledge bases sharing an embedder and a text
    configuration (vectors and lexemes compare only within one)."""

    mode: SearchMode
    text: str | None  # the query's text; None: a VECTOR search by a given vector
    vector: np.ndarray | None  # unit length, the pinned embedder's; None in TEXT mode or when...
    top_k: int
    min_score: float | None
    filtered: bool  # a metadata filter narrows the rows: exact scans reach further
    text_config: str  # the corpus's pinned text-search configuration
    dimension: int  # the pinned embedder's
    embedding: QueryEmbedding | None = None  # ...the engine embeds the query itself

    def __post_init__(self) -> None:
        if self.vector is not None and self.embedding is not None:
            raise ValueError("a search has a vector or a query to embed, not both")
        if (self.mode is SearchMode.TEXT) != (self.vector is None and self.embedding is None):
            raise ValueError("TEXT mode ranks by text alone; the other modes need a vector")


@dataclass(frozen=True)
class RoutedPlan:
    """A search's `SearchPlan`: called by the store with the searched rows' count (capped at
    `count_cap`), it routes the search (exact scan or HNSW) and says what to rank."""

    retrieval: Retrieval
    tuning: SearchTuning
    neighbours: bool  # fetch neighbours' scores (HYBRID with a neighbour weight)
    vector_later: Awaitable[np.ndarray] | None = None  # the query's vector, being embedded

    @property
    def count_cap(self) -> int:
        return self.tuning.count_cap

    def __call__(self, rows: int) -> CandidateQuery:
        search = self.retrieval
        exact = self.tuning.exact(rows, filtered=search.filtered, dimension=search.dimension)
        trace.get_current_span().set_attribute("tokensvc.search.exact", exact)
        vector_only = search.mode is SearchMode.VECTOR
        return candidate_query(
            vector=search.vector,
            text=None if vector_only else search.text,
            text_config=search.text_config,
            k=search.top_k if vector_only else max(search.top_k, self.tuning.candidates),
            rows=rows,
            exact=exact,
            neighbours=self.neighbours,
            tuning=self.tuning,
            vector_later=self.vector_later,
        )


Fetch = Callable[[RoutedPlan], Awaitable[SearchOutcome[T]]]
"""A store's search of one corpus with everything but the plan bound (tenant, bucket or bases,
filter): `lambda plan: store.search(tenant, bucket, plan, count_cap=plan.count_cap, ...)`."""


class RetrievalEngine:
    """Plans, fetches and fuses searches with one tuning and one set of fusion weights."""

    def __init__(self, tuning: SearchTuning | None = None, fusion: FusionWeights | None = None):
        self.tuning = tuning or SearchTuning()
        self.fusion = fusion or FusionWeights()

    def plan(self, retrieval: Retrieval, vector_later: Awaitable[np.ndarray] | None = None) -> RoutedPlan:
        neighbours = retrieval.mode is SearchMode.HYBRID and self.fusion.neighbour > 0
        return RoutedPlan(retrieval, self.tuning, neighbours, vector_later)

    async def search(self, retrieval: Retrieval, fetch: Fetch[T]) -> list[Ranked[T]]:
        """The search's results: at most `top_k`, at least `min_score`, best first."""
        embedding = retrieval.embedding
        if embedding is None:
            outcome = await fetch(self.plan(retrieval))
        elif retrieval.mode is SearchMode.HYBRID and embedding.unqueued():
            pending = asyncio.ensure_future(embedding.vector())
            try:
                outcome = await fetch(self.plan(retrieval, vector_later=pending))
            finally:
                _settle(pending)
        else:
            vector = await embedding.vector()
            outcome = await fetch(self.plan(dataclasses.replace(retrieval, vector=vector, embedding=None)))
        return apply_mode(
            retrieval.mode,
            outcome.candidates,
            self.fusion,
            top_k=retrieval.top_k,
            min_score=retrieval.min_score,
        )


async def embed_query(embedder: ScheduledEmbedder, text: str, namespace: str, agent: str) -> np.ndarray:
    """The query's vector, unit length, embedded in the query class in the agent's fair share."""
    with _tracer.start_as_current_span("embed", record_exception=False) as span:
        span.set_attribute("tokensvc.embed.count", 1)
        vector = await observe_embedding(
            embedder.spec.name, embedder.embed_query(text, fair_share(namespace, agent))
        )
        return unit_vector(vector, "query_text")


def _settle(pending: asyncio.Future[np.ndarray]) -> None:
    """Cancel an embedding the store never awaited (it failed first), or take its exception, so
    none is left running or reported as never retrieved."""
    if not pending.done():
        pending.cancel()
    elif not pending.cancelled():
        pending.exception()
