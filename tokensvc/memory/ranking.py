"""Search hits and reciprocal rank fusion of the vector and full-text rankings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokensvc.memory.models import MemoryRecord, ScoredMemory

__all__ = ["RRF_K", "SearchHit", "reciprocal_rank_fusion"]

# The constant from Cormack et al. (2009); it damps the weight of top ranks.
RRF_K = 60


@dataclass(frozen=True)
class SearchHit:
    memory: MemoryRecord
    score: float
    vector_rank: int  # 1-based; 0 = not ranked by the vector search
    text_rank: int  # 1-based; 0 = not ranked by full-text search


def reciprocal_rank_fusion(
    by_vector: Sequence[ScoredMemory], by_text: Sequence[ScoredMemory]
) -> list[SearchHit]:
    """Fused score = sum over rankers of 1 / (RRF_K + rank); ties keep vector order first."""
    ranks: dict[str, tuple[MemoryRecord, int, int]] = {}
    for rank, scored in enumerate(by_vector, 1):
        ranks[scored.memory.id] = (scored.memory, rank, 0)
    for rank, scored in enumerate(by_text, 1):
        memory, vector_rank, _ = ranks.get(scored.memory.id, (scored.memory, 0, 0))
        ranks[scored.memory.id] = (memory, vector_rank, rank)
    hits = [
        SearchHit(
            memory,
            (1 / (RRF_K + vector_rank) if vector_rank else 0.0)
            + (1 / (RRF_K + text_rank) if text_rank else 0.0),
            vector_rank,
            text_rank,
        )
        for memory, vector_rank, text_rank in ranks.values()
    ]
    hits.sort(key=lambda hit: (-hit.score, hit.vector_rank or 1 << 30, hit.text_rank or 1 << 30))
    return hits
