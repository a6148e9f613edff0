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
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from opentelemetry import trace

from tokensvc.embedders import ScheduledEmbedder, fair_share
from tokensvc.observability.metrics import observe_embedding
from tokensvc.retrieval.fusion import FusionWeights, Ranked, SearchMode, apply_mode
from tokensvc.retrieval.planning import candidate_query
from tokensvc.retrieval.routing import SearchTuning
from tokensvc.retrieval.vectors import unit_vector
from tokensvc.storage.records import CandidateQuery, SearchOutcome

__all__ = ["Fetch", "Retrieval", "RetrievalEngine", "RoutedPlan", "embed_query"]

T = TypeVar("T")
_tracer = trace.get_tracer("tokensvc.retrieval")


@dataclass(frozen=True)
class Retrieval:
    """One search of one corpus: a bucket, or knowledge bases sharing an embedder and a text
    configuration (vectors and lexemes compare only within one)."""

    mode: SearchMode
    text: str | None  # the query's text; None: a VECTOR search by a given vector
    vector: np.ndarray | None  # unit length, the pinned embedder's; None in TEXT mode
    top_k: int
    min_score: float | None
    filtered: bool  # a metadata filter narrows the rows: exact scans reach further
    text_config: str  # the corpus's pinned text-search configuration
    dimension: int  # the pinned embedder's


@dataclass(frozen=True)
class RoutedPlan:
    """A search's `SearchPlan`: called by the store with the searched rows' count (capped at
    `count_cap`), it routes the search (exact scan or HNSW) and says what to rank."""

    retrieval: Retrieval
    tuning: SearchTuning
    neighbours: bool  # fetch neighbours' scores (HYBRID with a neighbour weight)

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
        )


Fetch = Callable[[RoutedPlan], Awaitable[SearchOutcome[T]]]
"""A store's search of one corpus with everything but the plan bound (tenant, bucket or bases,
filter): `lambda plan: store.search(tenant, bucket, plan, count_cap=plan.count_cap, ...)`."""


class RetrievalEngine:
    """Plans, fetches and fuses searches with one tuning and one set of fusion weights."""

    def __init__(self, tuning: SearchTuning | None = None, fusion: FusionWeights | None = None):
        self.tuning = tuning or SearchTuning()
        self.fusion = fusion or FusionWeights()

    def plan(self, retrieval: Retrieval) -> RoutedPlan:
        neighbours = retrieval.mode is SearchMode.HYBRID and self.fusion.neighbour > 0
        return RoutedPlan(retrieval, self.tuning, neighbours)

    async def search(self, retrieval: Retrieval, fetch: Fetch[T]) -> list[Ranked[T]]:
        """The search's results: at most `top_k`, at least `min_score`, best first."""
        outcome = await fetch(self.plan(retrieval))
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
