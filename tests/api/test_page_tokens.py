"""Page tokens (every List RPC): any forged token is INVALID_ARGUMENT naming page_token, never a crash."""

from __future__ import annotations

import base64
import hashlib
import json
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support import json_parsed
from tokensvc.api.page_tokens import (
    decode_memory_cursor,
    decode_ref_position,
    encode_memory_cursor,
    encode_ref_position,
    listing_binding,
)
from tokensvc.errors import InvalidArgument
from tokensvc.memory.paging import PageCursor

FILTER = listing_binding(b"filter-bytes")
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=8,
)


def token_of(body: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps(body).encode()).decode().rstrip("=")


def test_an_issued_token_round_trips() -> None:
    cursor = PageCursor(datetime(2026, 1, 1, tzinfo=UTC), "6f1c0f4e-3c1a-4a57-9f1e-6d2c8f1b2a3c")
    assert decode_memory_cursor(encode_memory_cursor(cursor, FILTER), FILTER) == cursor


@pytest.mark.parametrize(
    "body",
    [
        {"c": "2026-01-01T00:00:00+00:00", "i": 1, "f": "x"},
        {"c": "2026-01-01T00:00:00+00:00", "i": [1], "f": "x"},
        {"c": "2026-01-01T00:00:00+00:00", "i": {"a": 1}, "f": "x"},
        {"c": 5, "i": "6f1c0f4e-3c1a-4a57-9f1e-6d2c8f1b2a3c", "f": "x"},
        {"c": "2026-01-01T00:00:00+00:00", "i": "6f1c0f4e-3c1a-4a57-9f1e-6d2c8f1b2a3c", "f": 7},
        ["c", "i", "f"],
        "c",
    ],
)
def test_right_keys_with_wrong_value_types_are_invalid_argument(body: Any) -> None:
    with pytest.raises(InvalidArgument) as refused:
        decode_memory_cursor(token_of(body), FILTER)
    assert refused.value.field == "page_token"


@given(JSON)
def test_any_forged_json_body_is_invalid_argument(body: Any) -> None:
    # Nothing but an issued token carries this filter's tag, so every forged body is refused.
    with pytest.raises(InvalidArgument) as refused:
        decode_memory_cursor(token_of(body), FILTER)
    assert refused.value.field == "page_token"


def test_a_document_token_is_bound_to_its_knowledge_base_and_filter() -> None:
    here = listing_binding("default", "kb-one", b"")
    token = encode_ref_position("doc-7", here)
    assert decode_ref_position(token, here) == "doc-7"
    for elsewhere in (listing_binding("default", "kb-two", b""), listing_binding("default", "kb-one", b"f")):
        with pytest.raises(InvalidArgument) as refused:
            decode_ref_position(token, elsewhere)
        assert refused.value.field == "page_token"


@given(JSON)
def test_any_forged_ref_token_is_invalid_argument(body: Any) -> None:
    with pytest.raises(InvalidArgument) as refused:
        decode_ref_position(token_of(body), listing_binding("default"))
    assert refused.value.field == "page_token"


def test_a_memory_token_is_not_a_document_token() -> None:
    binding = listing_binding("default")
    cursor = PageCursor(datetime(2026, 1, 1, tzinfo=UTC), "6f1c0f4e-3c1a-4a57-9f1e-6d2c8f1b2a3c")
    with pytest.raises(InvalidArgument):
        decode_ref_position(encode_memory_cursor(cursor, binding), binding)


@pytest.mark.parametrize("ref", ["\ud800", "a\udfffb", "\x00"])
def test_a_ref_token_with_the_right_tag_but_a_lone_surrogate_or_nul_is_invalid_argument(ref: str) -> None:
    # The tag is computable from public inputs, so a forger can pass the binding check.
    binding = listing_binding("default")
    body = json.dumps({"r": ref, "f": hashlib.sha256(binding).hexdigest()[:16]})
    token = base64.urlsafe_b64encode(body.encode()).decode().rstrip("=")
    with pytest.raises(InvalidArgument) as refused:
        decode_ref_position(token, binding)
    assert refused.value.field == "page_token"


DEEP_BODIES = [
    pytest.param("[" * 700, id="arrays-700-deep"),  # within the 1,024-character bound
    pytest.param('{"a":' * 100 + "1" + "}" * 100, id="objects-100-deep"),
    pytest.param('{"r": ' + "[" * 40 + '"x"' + "]" * 40 + ', "f": "x"}', id="a-value-40-deep"),
]


@pytest.mark.parametrize("body", DEEP_BODIES)
@pytest.mark.parametrize("decode", [decode_memory_cursor, decode_ref_position], ids=["memories", "refs"])
def test_a_deeply_nested_page_token_is_refused_before_any_json_is_parsed(
    monkeypatch: pytest.MonkeyPatch, decode: Any, body: str
) -> None:
    # Issue 35: depth is bounded up front, not left to the parser's recursion limit (which
    # depends on how deep the caller's stack already is).
    token = base64.urlsafe_b64encode(body.encode()).decode().rstrip("=")
    parsed = json_parsed(monkeypatch)
    with pytest.raises(InvalidArgument) as refused:
        decode(token, FILTER)
    assert refused.value.field == "page_token"
    assert parsed == []


def test_a_ref_with_brackets_and_quotes_pages_on() -> None:
    # Brackets inside a string are text, not nesting: a document ref may hold many of them.
    ref = '[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[{{{{{{{{{{{{{{{{{{\\"]]]]'
    binding = listing_binding("default", "kb-one", b"")
    assert decode_ref_position(encode_ref_position(ref, binding), binding) == ref
