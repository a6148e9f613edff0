"""Score fusion of the vector and text rankings, with context from each result's neighbours.

Measured on LoCoMo (docs/benchmarks.md): score fusion beat reciprocal rank fusion, and the
neighbour term added about 0.04 recall@10 more:

- each candidate's cosine similarity is min-max scaled over the candidates, its BM25 score divided
  by the best one, and the two are mixed: `base = w * vector + (1 - w) * text`, `w` =
  `vector_weight`. Ranks would throw the margins away: a text match on one rare shared word and a
  near-tie of cosines are different evidence.
- neighbours lend context: a memory remembered right before or after a strong match (or the chunk
  next to it in its document) is often the other half of the answer. A candidate whose better
  neighbour scores higher than itself is lifted towards it: `score = base + n * max(0,
  base(neighbour) - base)`, `n` = `neighbour_weight` < 1, neighbours scaled like candidates. The
  rows two places away count too, their base discounted by `second_neighbour` (0.8: +0.018
  recall@10 on LoCoMo, no category down; docs/benchmarks.md, "Recall attempts"). So a
  neighbour never overtakes the match that lifts it, and the best base score stays first: context
  reorders what follows the best match, never the best match itself. Neighbours are never results
  themselves. Scores stay within [0, 1].

Ties break by vector rank, then text rank, then the candidates' given order, so equal input gives
equal output.

The scores returned keep that order but are scaled to the best match's cosine similarity:
`score = max(0, best cosine) * fused / fused(best result)`. Scaling within the candidates hides
whether anything relevant was there at all: the least-bad memory of an unrelated question fused to
the same score as the answer to a good one (HYBRID's top-1 score told a question whose answer is
stored from one whose answer is not with an AUROC of 0.77 on LoCoMo's development half). The best
cosine carries that signal (0.99 there; docs/benchmarks.md, "Abstention"), so the best result's
score is the same number in HYBRID as in VECTOR, whatever the other candidates are, and one
`min_score` serves both modes (docs/api.md, "Scores").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, TypeVar

from tokensvc.storage.records import Candidate

__all__ = [
    "Candidate",
    "FusionWeights",
    "Ranked",
    "SearchMode",
    "apply_mode",
    "fuse",
    "rank_by_text",
    "rank_by_vector",
]

T = TypeVar("T")
_UNRANKED = 1 << 30


class SearchMode(StrEnum):
    VECTOR = "vector"
    TEXT = "text"
    HYBRID = "hybrid"


@dataclass(frozen=True)
class FusionWeights:
    vector: float = 0.5
    neighbour: float = 0.7
    # A second neighbour's base counts this much of itself as context (0: the adjacent ones only).
    second_neighbour: float = 0.8

    def __post_init__(self) -> None:
        if not all(0.0 <= w <= 1.0 for w in (self.vector, self.neighbour, self.second_neighbour)):
            raise ValueError("fusion weights must be between 0 and 1")


@dataclass(frozen=True)
class Ranked(Generic[T]):
    item: T
    score: float
    vector_rank: int
    text_rank: int


def fuse(candidates: Sequence[Candidate[T]], weights: FusionWeights) -> list[Ranked[T]]:
    """Candidates by fused score, best first, scaled to the best cosine (see the module docstring)."""
    if not candidates:
        return []
    low = min(c.vector_score for c in candidates)
    span = max(c.vector_score for c in candidates) - low
    best_text = max(c.text_score for c in candidates)

    def base(vector_score: float, text_score: float) -> float:
        vector = 1.0 if span <= 0 else min(1.0, max(0.0, (vector_score - low) / span))
        text = 0.0 if best_text <= 0 else min(1.0, max(0.0, text_score / best_text))
        return weights.vector * vector + (1.0 - weights.vector) * text

    bases = [base(c.vector_score, c.text_score) for c in candidates]
    # A neighbour outside the candidates may score above all of them: it lifts to the best, no more.
    ceiling = max(bases)
    ranked = []
    second = weights.second_neighbour
    for c, own in zip(candidates, bases, strict=True):
        context = [base(*n) for n in (c.previous, c.next) if n is not None]
        if second > 0:
            context += [second * base(*n) for n in (c.second_previous, c.second_next) if n is not None]
        lift = weights.neighbour * max(0.0, min(ceiling, max(context)) - own) if context else 0.0
        ranked.append(Ranked(c.item, own + lift, c.vector_rank, c.text_rank))
    ordered = _sorted(ranked)
    best = min(1.0, max(0.0, *(c.vector_score for c in candidates)))
    top = ordered[0].score
    scale = best / top if top > 0 else 0.0
    return [Ranked(r.item, r.score * scale, r.vector_rank, r.text_rank) for r in ordered]


def rank_by_vector(candidates: Sequence[Candidate[T]]) -> list[Ranked[T]]:
    """VECTOR mode: cosine similarity; ranks are not reported (0)."""
    return _sorted([Ranked(c.item, c.vector_score, c.vector_rank, 0) for c in candidates], report=False)


def rank_by_text(candidates: Sequence[Candidate[T]]) -> list[Ranked[T]]:
    """TEXT mode: by BM25 (text ranks reported); rows no query term matched are not results. The
    score is BM25 over the score no row reaches for the query (`Candidate.text_ideal`: every query
    term, its frequency saturated), in [0, 1): the idf-weighted share of the query a row matches,
    comparable across queries where raw BM25 is not (docs/api.md, "Scores")."""
    return _sorted([Ranked(c.item, _scaled_text(c), 0, c.text_rank) for c in candidates if c.text_rank])


def _scaled_text(c: Candidate[T]) -> float:
    if c.text_ideal is None or c.text_ideal <= 0:
        return c.text_score  # a store that does not say (none of tokensvc's)
    return min(1.0, c.text_score / c.text_ideal)


def _sorted(ranked: list[Ranked[T]], *, report: bool = True) -> list[Ranked[T]]:
    order = sorted(
        range(len(ranked)),
        key=lambda i: (
            -ranked[i].score,
            ranked[i].vector_rank or _UNRANKED,
            ranked[i].text_rank or _UNRANKED,
            i,
        ),
    )
    if report:
        return [ranked[i] for i in order]
    return [Ranked(ranked[i].item, ranked[i].score, 0, 0) for i in order]


def apply_mode(
    mode: SearchMode,
    candidates: Sequence[Candidate[T]],
    weights: FusionWeights,
    *,
    top_k: int,
    min_score: float | None,
) -> list[Ranked[T]]:
    """The search's results: ranked in `mode`, at least `min_score` (when set), at most `top_k`."""
    if mode is SearchMode.VECTOR:
        ranked = rank_by_vector(candidates)
    elif mode is SearchMode.TEXT:
        ranked = rank_by_text(candidates)
    else:
        ranked = fuse(candidates, weights)
    if min_score is not None:
        ranked = [r for r in ranked if r.score >= min_score]
    return ranked[:top_k]
