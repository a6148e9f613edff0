"""The in-process text ranker: a `simple` tokeniser and the BM25 of the PostgreSQL stores.

The formula is `tokensvc.storage.postgres.ranking`'s, term for term: per row d and query term t
over the rows the query matches, `idf(t) * tf * (k1 + 1) / (tf + k1 * (1 - b + b * |d| / avg|d|))`,
`idf(t) = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5))`, N = max(the plan's row count, the matching
rows), |d| = the row's distinct terms, avg|d| over the matching rows.

What differs from PostgreSQL is the tokeniser. PostgreSQL parses with its text-search parser and
normalises with the pinned configuration's dictionaries (`english` stems and drops stop words).
Here every configuration behaves like `simple` with plain words: a term is a maximal run of
letters and digits, casefolded. So words differ from PostgreSQL's when stemming or stop words
matter ("apples" is not "apple", "the" is a term), for hyphenated compounds (PostgreSQL also
indexes "pg-stage-3" whole), URLs, e-mail addresses, paths and version numbers (one token there,
several here), and for very long texts (PostgreSQL keeps at most 256 positions per term and
none past position 16,383; term frequencies are not capped here). PostgreSQL scores at most
10,000 matching rows per search (`MAX_TEXT_MATCHES`); every matching row is scored here.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence

__all__ = ["Terms", "bm25_ideal", "bm25_scores", "terms_of"]

Terms = Mapping[str, int]
"""A text's terms with their frequencies (what a tsvector holds, positions aside)."""

_WORD = re.compile(r"[^\W_]+")
# `or_text` separates its alternatives with the word `or` (websearch_to_tsquery's operator).
_OR = "or"


def terms_of(text: str) -> Counter[str]:
    """The terms of `text` and how often each occurs."""
    return Counter(_WORD.findall(text.casefold()))


def bm25_scores(
    rows: Sequence[Terms], text: str, or_text: str, *, row_count: int, k1: float, b: float
) -> dict[int, float]:
    """BM25 of every row (by index into `rows`) that contains a query term.

    `or_text` selects the matching rows (any of its alternatives), `text` gives the scored terms;
    the domain builds both from the same words, so every matching row has a score.
    """
    terms, matched, n, df = _statistics(rows, text, or_text, row_count)
    if not matched or not terms:
        return {}
    avgdl = sum(len(rows[i]) for i in matched) / len(matched)
    scores: dict[int, float] = {}
    for i in matched:
        row = rows[i]
        found = [t for t in terms if t in row]
        if not found:
            continue
        norm = k1 * (1 - b + b * len(row) / avgdl)
        scores[i] = sum(_idf(n, df[t]) * row[t] * (k1 + 1) / (row[t] + norm) for t in found)
    return scores


def bm25_ideal(rows: Sequence[Terms], text: str, or_text: str, *, row_count: int, k1: float) -> float:
    """The BM25 score no row reaches: every query term, its frequency saturated (`k1 + 1`), with
    the idf the scores use (a term no row holds counts too). The statements' `ideal`."""
    terms, _, n, df = _statistics(rows, text, or_text, row_count)
    return sum(_idf(n, df[t]) for t in terms) * (k1 + 1)


def _statistics(
    rows: Sequence[Terms], text: str, or_text: str, row_count: int
) -> tuple[set[str], list[int], float, Counter[str]]:
    """The query's terms, the matching rows, N and each term's df among the matching rows."""
    alternatives = set(terms_of(or_text)) - {_OR}
    terms = set(terms_of(text))
    matched = [i for i, row in enumerate(rows) if not alternatives.isdisjoint(row)]
    n = max(float(row_count), float(len(matched)))
    df = Counter(t for i in matched for t in terms if t in rows[i])
    return terms, matched, n, df


def _idf(n: float, df: int) -> float:
    return math.log(1 + (n - df + 0.5) / (df + 0.5))
