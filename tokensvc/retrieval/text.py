"""Full-text ranking for questions: OR over the query's terms, stemmed, rare terms weigh more.

A natural-language question ("what language does the user like") shares few words with the
memory that answers it, so requiring every word (AND, what `websearch_to_tsquery` does with plain
words) matches almost nothing. Instead every term of the query is an alternative (OR); the
text-search configuration pinned to the memory space or knowledge base stems them and drops its
stop words; and the ranking is BM25 (Robertson et al.), which weighs a term by how rare it is in the
bucket or corpus, so the one rare shared word ("French", "pg-stage-3") outweighs common ones.

The statements are built in `tokensvc.storage.postgres.ranking`; this module owns the rules. Matching and
scoring use the same words (`query_words`): what scores also matches.
"""

from __future__ import annotations

import re

from tokensvc.errors import InvalidArgument
from tokensvc.names import TEXT_CONFIGS

__all__ = [
    "BM25_B",
    "BM25_K1",
    "DEFAULT_TEXT_CONFIG",
    "MAX_QUERY_TERMS",
    "TEXT_CONFIGS",
    "or_query",
    "query_words",
    "validate_text_config",
]

DEFAULT_TEXT_CONFIG = "english"

# BM25 term-frequency saturation and length normalisation. Memories and chunks are short, so
# length matters less than in the classic b = 0.75 (measured on LoCoMo: docs/benchmarks.md).
BM25_K1 = 0.6
BM25_B = 0.3

# More words than this add cost, not ranking: a question has a dozen. Larger than any stop-word
# list, so padding a question with distinct stop words cannot push its real terms out.
MAX_QUERY_TERMS = 256
_TERM = re.compile(r"\w+")


def query_words(text: str) -> list[str]:
    """The query's distinct words (casefolded `\\w+` runs, without `or`), at most MAX_QUERY_TERMS,
    in order: the text ranker matches and scores exactly these (after stemming)."""
    terms = dict.fromkeys(t for t in _TERM.findall(text.casefold()) if t != "or")
    return list(terms)[:MAX_QUERY_TERMS]


def or_query(text: str) -> str:
    """The query's words as `websearch_to_tsquery` alternatives: `w1 or w2 or ...`.

    Only word characters survive, so no operator syntax (quotes, `-`, `or` between words of the
    caller's) reaches the parser; the word `or` itself is dropped as a stop word would be. Empty
    when the text has no words (then the text ranker matches nothing).
    """
    return " or ".join(query_words(text))


def validate_text_config(value: str, field: str) -> str:
    """`value` if it names a built-in configuration, else INVALID_ARGUMENT naming `field`."""
    if value not in TEXT_CONFIGS:
        raise InvalidArgument(
            field,
            f"{value[:64]!r} is not a text-search configuration; one of {', '.join(sorted(TEXT_CONFIGS))}",
        )
    return value
