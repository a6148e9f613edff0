"""The one retrieval engine memories and knowledge bases share.

- `engine`: a search from its query to its results: the routed plan the store calls with the
  searched rows' count, then fusion (`RetrievalEngine`), and the query's embedding;
- `vectors`: unit-length normalisation of every stored and query vector (float64 maths);
- `routing`: exact scan or HNSW by bucket/corpus size, the HNSW scan settings;
- `text`: the text ranker's rules (OR over stemmed terms, BM25, pinned text-search configs);
- `planning`: the `CandidateQuery` a search hands the store;
- `fusion`: score fusion of the vector and text rankings with neighbour context, tie-breaks.

The SQL that fetches candidates with both scores is `tokensvc.storage.postgres.ranking`; the
caches of row counts and pins are store decorators (`tokensvc.storage.caching`).
"""

from __future__ import annotations

from tokensvc.retrieval.document_embedding import batch_size_of, embed_texts
from tokensvc.retrieval.engine import (
    Fetch,
    QueryEmbedding,
    Retrieval,
    RetrievalEngine,
    RoutedPlan,
    embed_query,
)
from tokensvc.retrieval.fusion import (
    Candidate,
    FusionWeights,
    Ranked,
    SearchMode,
    apply_mode,
    fuse,
    rank_by_text,
    rank_by_vector,
)
from tokensvc.retrieval.planning import candidate_query
from tokensvc.retrieval.routing import HNSW_MAX_DIMENSION, SearchTuning
from tokensvc.retrieval.text import (
    BM25_B,
    BM25_K1,
    DEFAULT_TEXT_CONFIG,
    TEXT_CONFIGS,
    or_query,
    query_words,
    validate_text_config,
)
from tokensvc.retrieval.vectors import unit_rows, unit_vector

__all__ = [
    "BM25_B",
    "BM25_K1",
    "DEFAULT_TEXT_CONFIG",
    "HNSW_MAX_DIMENSION",
    "TEXT_CONFIGS",
    "Candidate",
    "Fetch",
    "FusionWeights",
    "QueryEmbedding",
    "Ranked",
    "Retrieval",
    "RetrievalEngine",
    "RoutedPlan",
    "SearchMode",
    "SearchTuning",
    "apply_mode",
    "batch_size_of",
    "candidate_query",
    "embed_query",
    "embed_texts",
    "fuse",
    "or_query",
    "query_words",
    "rank_by_text",
    "rank_by_vector",
    "unit_rows",
    "unit_vector",
    "validate_text_config",
]
