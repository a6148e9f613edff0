"""Fusion of the vector and text rankings: properties that hold for any candidates (hypothesis)."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokensvc.retrieval import Candidate, FusionWeights, SearchMode, apply_mode, fuse

scores = st.floats(min_value=-1.0, max_value=1.0, allow_nan=False)
# BM25 scores are 0 (no match) or well above the float minimum.
bm25 = st.one_of(st.just(0.0), st.floats(min_value=1e-6, max_value=50.0))
neighbour = st.one_of(st.none(), st.tuples(scores, bm25))


@st.composite
def candidate_lists(draw: st.DrawFn) -> list[Candidate[int]]:
    count = draw(st.integers(min_value=0, max_value=30))
    vector = draw(st.lists(scores, min_size=count, max_size=count))
    text = draw(st.lists(bm25, min_size=count, max_size=count))
    by_vector = sorted(range(count), key=lambda i: -vector[i])
    by_text = [i for i in sorted(range(count), key=lambda i: -text[i]) if text[i] > 0]
    return [
        Candidate(
            i,
            vector[i],
            text[i],
            by_vector.index(i) + 1,
            by_text.index(i) + 1 if i in by_text else 0,
            draw(neighbour),
            draw(neighbour),
            second_previous=draw(neighbour),
            second_next=draw(neighbour),
        )
        for i in range(count)
    ]


weights = st.builds(
    FusionWeights,
    vector=st.floats(min_value=0.0, max_value=1.0),
    neighbour=st.floats(min_value=0.0, max_value=1.0),
    second_neighbour=st.floats(min_value=0.0, max_value=1.0),
)


@given(candidate_lists(), weights)
def test_fusion_returns_every_candidate_once_best_first_with_bounded_scores(
    candidates: list[Candidate[int]], w: FusionWeights
) -> None:
    ranked = fuse(candidates, w)
    assert sorted(r.item for r in ranked) == sorted(c.item for c in candidates)
    assert all(a.score >= b.score for a, b in itertools.pairwise(ranked))
    assert all(math.isfinite(r.score) and 0.0 <= r.score <= 1.0 + 1e-9 for r in ranked)


@given(candidate_lists(), weights)
def test_fusion_is_deterministic_and_keeps_each_candidates_ranks(
    candidates: list[Candidate[int]], w: FusionWeights
) -> None:
    first, second = fuse(candidates, w), fuse(list(candidates), w)
    assert first == second
    by_item = {c.item: c for c in candidates}
    for r in first:
        assert (r.vector_rank, r.text_rank) == (by_item[r.item].vector_rank, by_item[r.item].text_rank)


@given(candidate_lists())
def test_with_all_weight_on_vectors_and_no_neighbours_fusion_is_the_vector_ranking(
    candidates: list[Candidate[int]],
) -> None:
    ranked = fuse(candidates, FusionWeights(vector=1.0, neighbour=0.0))
    assert [r.item for r in ranked] == [c.item for c in sorted(candidates, key=lambda c: c.vector_rank)]


@given(candidate_lists())
def test_with_all_weight_on_text_a_text_match_never_ranks_below_a_non_match(
    candidates: list[Candidate[int]],
) -> None:
    ranked = fuse(candidates, FusionWeights(vector=0.0, neighbour=0.0))
    matched = [r.item for r in ranked if candidates[r.item].text_score > 0]
    assert [r.item for r in ranked][: len(matched)] == matched


@given(candidate_lists(), weights, st.data())
def test_a_candidate_better_on_every_score_ranks_at_least_as_high(
    candidates: list[Candidate[int]], w: FusionWeights, data: st.DataObject
) -> None:
    if len(candidates) < 2:
        return
    a, b = data.draw(st.lists(st.sampled_from(range(len(candidates))), min_size=2, max_size=2, unique=True))
    ca, cb = candidates[a], candidates[b]

    def covered(n: tuple[float, float] | None, by: tuple[tuple[float, float] | None, ...]) -> bool:
        return n is None or any(p is not None and p[0] >= n[0] and p[1] >= n[1] for p in by)

    adjacent = (ca.previous, ca.next)
    # b's adjacent neighbours by a's adjacent ones; b's second ones (discounted) by any of a's.
    dominates = (
        ca.vector_score >= cb.vector_score
        and ca.text_score >= cb.text_score
        and all(covered(n, adjacent) for n in (cb.previous, cb.next))
        and all(
            covered(n, (*adjacent, ca.second_previous, ca.second_next))
            for n in (cb.second_previous, cb.second_next)
        )
    )
    if not dominates:
        return
    order = [r.item for r in fuse(candidates, w)]
    score = {r.item: r.score for r in fuse(candidates, w)}
    assert score[a] >= score[b] - 1e-12
    if score[a] > score[b]:
        assert order.index(a) < order.index(b)


def test_a_neighbour_of_a_strong_match_outranks_an_equal_candidate_without_one() -> None:
    lonely = Candidate("lonely", 0.5, 0.0, 2, 0)
    befriended = Candidate("befriended", 0.5, 0.0, 3, 0, previous=(0.9, 4.0))
    best = Candidate("best", 0.9, 4.0, 1, 1)
    ranked = fuse([lonely, befriended, best], FusionWeights())
    assert [r.item for r in ranked] == ["best", "befriended", "lonely"]


def test_a_second_neighbour_lends_discounted_context_and_none_when_turned_off() -> None:
    best = Candidate("best", 0.9, 4.0, 1, 1)
    near = Candidate("near", 0.5, 0.0, 3, 0, previous=(0.9, 4.0))
    far = Candidate("far", 0.5, 0.0, 2, 0, second_previous=(0.9, 4.0))
    lonely = Candidate("lonely", 0.5, 0.0, 4, 0)

    ranked = fuse([lonely, far, near, best], FusionWeights())
    adjacent_only = fuse([lonely, far, near, best], FusionWeights(second_neighbour=0.0))

    assert [r.item for r in ranked] == ["best", "near", "far", "lonely"]
    assert ranked[2].score > ranked[3].score, "two places away still lifts"
    assert [r.item for r in adjacent_only] == ["best", "near", "far", "lonely"]
    assert adjacent_only[2].score == adjacent_only[3].score, "far equals lonely without the second"


@given(candidate_lists(), weights)
def test_neighbours_never_move_the_best_base_score_from_first_place(
    candidates: list[Candidate[int]], w: FusionWeights
) -> None:
    if not candidates or w.neighbour >= 1.0:
        return
    without = fuse(candidates, FusionWeights(vector=w.vector, neighbour=0.0, second_neighbour=0.0))
    with_context = fuse(candidates, w)
    assert with_context[0].score == pytest.approx(without[0].score)


def test_ties_break_by_vector_rank_then_text_rank() -> None:
    a = Candidate("a", 0.5, 1.0, 2, 1)
    b = Candidate("b", 0.5, 1.0, 1, 2)
    assert [r.item for r in fuse([a, b], FusionWeights())] == ["b", "a"]


@settings(max_examples=50)
@given(candidate_lists(), st.integers(min_value=1, max_value=10), st.one_of(st.none(), scores))
def test_modes_cut_to_top_k_and_drop_results_below_min_score(
    candidates: list[Candidate[int]], top_k: int, min_score: float | None
) -> None:
    for mode in SearchMode:
        ranked = apply_mode(mode, candidates, FusionWeights(), top_k=top_k, min_score=min_score)
        assert len(ranked) <= top_k
        assert min_score is None or all(r.score >= min_score for r in ranked)


def test_vector_mode_scores_are_cosines_and_report_no_ranks() -> None:
    candidates = [Candidate("x", 0.2, 3.0, 2, 1), Candidate("y", 0.8, 0.0, 1, 0)]
    ranked = apply_mode(SearchMode.VECTOR, candidates, FusionWeights(), top_k=10, min_score=None)
    assert [(r.item, r.score, r.vector_rank, r.text_rank) for r in ranked] == [
        ("y", 0.8, 0, 0),
        ("x", 0.2, 0, 0),
    ]


def test_text_mode_returns_only_text_matches_by_bm25() -> None:
    candidates = [Candidate("x", 0.9, 0.0, 1, 0), Candidate("y", 0.1, 2.5, 2, 1)]
    ranked = apply_mode(SearchMode.TEXT, candidates, FusionWeights(), top_k=10, min_score=None)
    assert [(r.item, r.score, r.vector_rank, r.text_rank) for r in ranked] == [("y", 2.5, 0, 1)]


@pytest.mark.parametrize(("vector", "neighbour"), [(-0.1, 0.3), (0.5, 1.5)])
def test_weights_outside_zero_to_one_are_refused(vector: float, neighbour: float) -> None:
    with pytest.raises(ValueError, match="between 0 and 1"):
        FusionWeights(vector=vector, neighbour=neighbour)


# --- HYBRID's scores: the fusion's order, scaled to the best match's cosine ---------------------


@given(candidate_lists(), weights)
def test_the_best_hybrid_score_is_the_best_cosine_and_no_other_scores_higher(
    candidates: list[Candidate[int]], w: FusionWeights
) -> None:
    ranked = fuse(candidates, w)
    if not candidates or ranked[0].score == 0:
        return
    best_cosine = max(c.vector_score for c in candidates)
    assert ranked[0].score == pytest.approx(max(0.0, best_cosine))
    assert all(r.score <= ranked[0].score + 1e-12 for r in ranked)


def _candidate(item: str, cosine: float, bm25: float, vector_rank: int, text_rank: int) -> Candidate[str]:
    return Candidate(item, cosine, bm25, vector_rank, text_rank, None, None)


def test_the_best_hybrid_score_does_not_depend_on_the_other_candidates() -> None:
    # The same best match among close rivals and among poor ones: min-max scaling scored it 1.0 in
    # both and said nothing of the match itself; now it is its cosine in both.
    close = [_candidate("answer", 0.86, 4.0, 1, 1), _candidate("rival", 0.855, 3.0, 2, 2)]
    poor = [_candidate("answer", 0.86, 4.0, 1, 1), _candidate("noise", 0.70, 0.0, 2, 0)]
    for candidates in (close, poor):
        best = fuse(candidates, FusionWeights())[0]
        assert (best.item, best.score) == ("answer", pytest.approx(0.86))


def test_min_score_answers_nothing_from_an_unrelated_bucket_and_keeps_the_match() -> None:
    unrelated = [_candidate("allergy", 0.75, 0.0, 1, 0), _candidate("meeting", 0.74, 0.0, 2, 0)]
    related = [_candidate("meeting", 0.85, 2.5, 1, 1), _candidate("allergy", 0.75, 0.0, 2, 0)]
    search = {"top_k": 5, "min_score": 0.8}
    assert apply_mode(SearchMode.HYBRID, unrelated, FusionWeights(), **search) == []
    found = apply_mode(SearchMode.HYBRID, related, FusionWeights(), **search)
    assert [(r.item, r.score) for r in found] == [("meeting", pytest.approx(0.85))]


def test_text_mode_scores_are_bm25_over_the_score_no_row_reaches() -> None:
    full = Candidate("full", 0.0, 6.0, 0, 1, text_ideal=8.0)
    partial = Candidate("partial", 0.0, 2.0, 0, 2, text_ideal=8.0)

    ranked = apply_mode(SearchMode.TEXT, [partial, full], FusionWeights(), top_k=5, min_score=0.5)

    assert [(r.item, r.score) for r in ranked] == [("full", 0.75)]
