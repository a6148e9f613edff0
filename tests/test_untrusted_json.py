"""JSON from outside the process: size and nesting are bounded before anything is parsed."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.support import b64url, json_parsed
from tokensvc.untrusted_json import MAX_DEPTH, UntrustedJsonError, parse, parse_base64url


@pytest.mark.parametrize(
    "document",
    [
        "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1),
        '{"a":' * (MAX_DEPTH + 1) + "1" + "}" * (MAX_DEPTH + 1),
        "[" * 100_000,
        '["x", ' + "[{" * 20 + "]}" * 20 + "]",
    ],
    ids=["arrays", "objects", "unclosed", "mixed-in-a-list"],
)
def test_a_document_nested_past_the_bound_is_refused_unparsed(
    monkeypatch: pytest.MonkeyPatch, document: str
) -> None:
    parsed = json_parsed(monkeypatch)
    with pytest.raises(UntrustedJsonError):
        parse(document, max_bytes=len(document))
    assert parsed == []


def test_a_document_at_the_bound_parses() -> None:
    document = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert parse(document, max_bytes=len(document)) is not None


def test_brackets_and_escaped_quotes_inside_strings_are_not_nesting() -> None:
    value = ["[" * 100 + '\\"{' * 100, {"k": "]]]}}}"}]
    document = json.dumps(value)
    assert parse(document, max_bytes=len(document)) == value


@pytest.mark.parametrize("document", ["[1]", b"[1]"])
def test_a_document_over_its_size_bound_is_refused_unparsed(
    monkeypatch: pytest.MonkeyPatch, document: str | bytes
) -> None:
    parsed = json_parsed(monkeypatch)
    with pytest.raises(UntrustedJsonError):
        parse(document, max_bytes=2)
    assert parsed == []


@pytest.mark.parametrize(
    "document",
    [b"\xff[]", '["a"]'.encode("utf-16"), b"\xef\xbb\xbf[]", b"not json", b"", b"[1,]"],
    ids=["not-utf8", "utf16", "bom", "garbage", "empty", "trailing-comma"],
)
def test_anything_but_utf8_json_is_refused(document: bytes) -> None:
    with pytest.raises(UntrustedJsonError):
        parse(document, max_bytes=100)


def test_a_hooks_value_error_is_a_refusal() -> None:
    def refuse(pairs: list[tuple[str, Any]]) -> Any:
        raise ValueError("no")

    with pytest.raises(UntrustedJsonError):
        parse("{}", max_bytes=10, object_pairs_hook=refuse)


def test_base64url_is_bounded_by_its_own_length_first() -> None:
    assert parse_base64url(b64url(b'{"a":"b"}'), max_chars=20) == {"a": "b"}
    for token in (b64url(b"[" + b" " * 30 + b"]"), "!!!!", "A"):
        with pytest.raises(UntrustedJsonError):
            parse_base64url(token, max_chars=20)
