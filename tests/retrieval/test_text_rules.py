"""The text ranker's rules that need no database: the OR query and the pinned configurations."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokensvc.errors import InvalidArgument
from tokensvc.retrieval import TEXT_CONFIGS, or_query, validate_text_config
from tokensvc.retrieval.text import MAX_QUERY_TERMS


def test_a_question_becomes_alternatives_of_its_words() -> None:
    assert or_query("What language does the user like?") == "what or language or does or the or user or like"


def test_operator_syntax_of_the_caller_is_not_passed_through() -> None:
    # Quotes, minus and `or` would be websearch syntax: only words survive, `or` is dropped.
    assert or_query('"exact phrase" -excluded this OR that') == "exact or phrase or excluded or this or that"


def test_repeated_words_count_once_and_the_query_is_capped() -> None:
    assert or_query("deploy Deploy DEPLOY window") == "deploy or window"
    assert len(or_query(" ".join(f"w{i}" for i in range(500))).split(" or ")) == MAX_QUERY_TERMS


def test_a_query_without_words_matches_nothing() -> None:
    assert or_query("?! -- ...") == ""


@given(st.text(max_size=200))
def test_any_text_gives_only_word_terms_joined_by_or(text: str) -> None:
    query = or_query(text)
    terms = query.split(" or ") if query else []
    assert all(re.fullmatch(r"\w+", term) for term in terms)
    assert "or" not in terms
    assert len(terms) == len(set(terms))


def test_only_postgresqls_built_in_configurations_are_accepted() -> None:
    assert {"english", "simple", "french", "german"} <= TEXT_CONFIGS
    assert validate_text_config("simple", "text_search_config") == "simple"
    for bad in ("klingon", "english; DROP TABLE memories", "pg_catalog.english", "English", "english\x00"):
        with pytest.raises(InvalidArgument) as refused:
            validate_text_config(bad, "text_search_config")
        assert refused.value.field == "text_search_config"
