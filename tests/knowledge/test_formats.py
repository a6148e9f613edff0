"""Document formats: what each content type yields, and which uploads are refused, naming the field."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokensvc.api.status import status_for
from tokensvc.errors import InvalidArgument
from tokensvc.knowledge import ChunkingKind, ChunkingStrategy, chunk_document, extract_text

HANDBOOK = (Path(__file__).parent / "fixtures" / "handbook.md").read_bytes()

PAGE = b"""<!DOCTYPE html>
<html>
<head><title>Head title is metadata</title><style>p { color: red; }</style>
<script>var inHead = 1;</script></head>
<body>
<!-- a comment is not text -->
<nav><a href="/">Home</a></nav>
<h1>Runbook &amp; <em>Guide</em></h1>
<p>Check the   pool
   first.</p>
<script type="text/javascript">document.write("script text");</script>
<noscript>Enable JavaScript</noscript>
<template><p>template text</p></template>
<div><h2>Restarts</h2><p>Restart one replica<br>at a time.</p>
<ul><li>drain</li><li>restart</li></ul></div>
<h3>Commands</h3>
<pre>
# drain the node first
kubectl drain node-1
</pre>
<p># a paragraph that only looks like a heading</p>
<table><tr><th>Signal</th><th>Action</th></tr><tr><td>5xx</td><td>roll back</td></tr></table>
<h2>Escalation</h2>
<p>Page the&nbsp;secondary.</p>
<style>.late { display: none; }</style>
</body></html>"""


def invalid(content: bytes, content_type: str, **kwargs: str) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as caught:
        extract_text(content, content_type, **kwargs)
    assert status_for(caught.value).code is grpc.StatusCode.INVALID_ARGUMENT
    return caught.value


# --- plain text and markdown ---------------------------------------------------------------------


@pytest.mark.parametrize("content_type", ["text/plain", "text/markdown"])
def test_plain_and_markdown_text_is_returned_exactly_as_decoded(content_type: str) -> None:
    content = "Zürich 🚀 e\u0301\r\n\r\n# Title\ttabs  and  spaces\rold mac line\n".encode()
    assert extract_text(content, content_type) == content.decode()


def test_a_leading_byte_order_mark_is_dropped_and_nothing_else() -> None:
    assert extract_text("\ufeffhello\ufeff".encode(), "text/plain") == "hello\ufeff"


@pytest.mark.parametrize(
    "content_type",
    [
        "text/markdown; charset=utf-8",
        "TEXT/Markdown;charset=UTF-8",
        'text/markdown; charset="utf-8"',
        "text/markdown; charset=us-ascii",
        "text/markdown; variant=GFM; charset=utf8",
        " text/markdown ",
    ],
)
def test_content_type_parameters_are_accepted(content_type: str) -> None:
    assert extract_text(b"# Hi\n", content_type) == "# Hi\n"


def test_handbook_markdown_extracts_unchanged_and_chunks_with_exact_offsets() -> None:
    text = extract_text(HANDBOOK, "text/markdown; charset=utf-8")
    assert text == HANDBOOK.decode()
    for chunk in chunk_document(text, ChunkingStrategy(ChunkingKind.MARKDOWN, 128, 16)):
        assert text[chunk.start : chunk.end] == chunk.text


@settings(max_examples=200, deadline=None)
@given(st.text(st.characters(codec="utf-8", exclude_categories=("Cs",), exclude_characters="\x00")))
def test_any_plain_text_with_content_extracts_to_itself(text: str) -> None:
    if text.removeprefix("\ufeff").strip():
        assert extract_text(text.encode(), "text/plain") == text.removeprefix("\ufeff")


# --- refusals --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content_type",
    ["image/png", "application/msword", "text/html+xml", "", "text", "application/zip; charset=utf-8"],
)
def test_unsupported_content_types_name_the_content_type_field(content_type: str) -> None:
    error = invalid(b"hello", content_type)
    assert error.field == "header.content_type"
    assert "text/plain, text/markdown, text/html, application/pdf" in error.message


@pytest.mark.parametrize(
    "content_type", ["text/plain; charset=latin-1", "text/html; charset=utf-16", "text/plain; charset"]
)
def test_other_charsets_and_malformed_parameters_are_refused(content_type: str) -> None:
    assert invalid(b"hello", content_type).field == "header.content_type"


def test_the_caller_chooses_the_content_type_field_path() -> None:
    assert invalid(b"x", "image/png", field="documents[2].content_type").field == "documents[2].content_type"


@pytest.mark.parametrize("content_type", ["text/plain", "text/markdown", "text/html"])
def test_invalid_utf8_names_the_content_field(content_type: str) -> None:
    error = invalid(b"valid start \xc3\x28 then junk", content_type)
    assert error.field == "content"
    assert "is not valid UTF-8" in error.message
    assert "byte 12" in error.message


def test_latin1_bytes_are_not_utf8() -> None:
    assert invalid("Café".encode("latin-1"), "text/plain; charset=utf-8").field == "content"


def test_nul_characters_are_refused_before_anything_is_stored() -> None:
    error = invalid(b"before\x00after", "text/plain")
    assert error.field == "content"
    assert "U+0000" in error.message


@pytest.mark.parametrize(
    ("content", "content_type"),
    [
        (b"", "text/plain"),
        (b"\xef\xbb\xbf", "text/markdown"),
        (b" \r\n\t\n", "text/plain"),
        (
            b"<html><head><title>t</title></head><body><script>x()</script> <!-- c --></body></html>",
            "text/html",
        ),
    ],
)
def test_documents_without_text_are_refused(content: bytes, content_type: str) -> None:
    error = invalid(content, content_type)
    assert error.field == "content"
    assert error.message == "content: has no text"


# --- HTML ------------------------------------------------------------------------------------------


def test_html_is_rendered_as_markdown_text_without_scripts_styles_or_head() -> None:
    text = extract_text(PAGE, "text/html; charset=utf-8")
    assert text == (
        "Home\n\n"
        "# Runbook & Guide\n\n"
        "Check the pool first.\n\n"
        "## Restarts\n\n"
        "Restart one replica\nat a time.\n\n"
        "drain\nrestart\n\n"
        "### Commands\n\n"
        "```\n# drain the node first\nkubectl drain node-1\n```\n\n"
        "\\# a paragraph that only looks like a heading\n\n"
        "Signal | Action\n5xx | roll back\n\n"
        "## Escalation\n\n"
        "Page the secondary."
    )
    for hidden in ("inHead", "color", "script text", "JavaScript", "template text", "display", "comment"):
        assert hidden not in text


def test_html_headings_give_markdown_heading_paths() -> None:
    text = extract_text(PAGE, "text/html")
    chunks = chunk_document(text, ChunkingStrategy(ChunkingKind.MARKDOWN, 16, 0))
    first_lines: dict[tuple[str, ...], str] = {}
    for chunk in chunks:
        first_lines.setdefault(chunk.heading_path, chunk.text.splitlines()[0])
    assert list(first_lines.items()) == [
        ((), "Home"),
        (("Runbook & Guide",), "# Runbook & Guide"),
        (("Runbook & Guide", "Restarts"), "## Restarts"),
        (("Runbook & Guide", "Restarts", "Commands"), "### Commands"),
        (("Runbook & Guide", "Escalation"), "## Escalation"),
    ]
    for chunk in chunks:
        assert text[chunk.start : chunk.end] == chunk.text


def test_html_preformatted_text_keeps_its_lines_inside_a_longer_fence() -> None:
    html = b"<pre>a  b\r\n```\r\n  indented</pre><p>after</p>"
    assert extract_text(html, "text/html") == "````\na  b\n```\n  indented\n````\n\nafter"


def test_html_blank_runs_collapse_to_one_blank_line() -> None:
    html = b"<div><p>one</p><p></p><div><br><br><br></div><section><p>two</p></section></div>"
    assert extract_text(html, "text/html") == "one\n\ntwo"


def test_deeply_nested_html_does_not_exhaust_the_stack() -> None:
    html = b"<div>" * 20_000 + b"<h2>Deep</h2><p>text</p>" + b"</div>" * 20_000
    assert extract_text(html, "text/html") == "## Deep\n\ntext"


def test_empty_html_headings_are_dropped_and_inline_tags_joined() -> None:
    html = b"<h1> </h1><h2>Sub<span>title</span>  <i>here</i></h2><p>x<b>y</b> z</p>"
    assert extract_text(html, "text/html") == "## Subtitle here\n\nxy z"


_HTML_PIECES = st.sampled_from(
    [
        "<p>",
        "</p>",
        "<div>",
        "</div>",
        "<h1>",
        "</h1>",
        "<h3>",
        "<pre>",
        "</pre>",
        "<br>",
        "<li>",
        "<script>",
        "</script>",
        "<td>",
        "<tr>",
        "<!--",
        "-->",
        "&amp;",
        "&#0;",
        "<",
        ">",
        "\r\n",
        " ",
        "# x",
        "```",
        "word",
        "Zürich",
        "e\u0301",
        "\U0001f680",
    ]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_HTML_PIECES, max_size=60).map("".join))
def test_any_html_extracts_to_chunkable_text_or_is_refused_as_textless(html: str) -> None:
    outcome: str | InvalidArgument
    try:
        outcome = extract_text(html.encode(), "text/html")
    except InvalidArgument as error:
        outcome = error
    if isinstance(outcome, InvalidArgument):
        assert outcome.message == "content: has no text"
        return
    text = outcome
    assert "\r" not in text
    assert "\n\n\n" not in text
    assert text == text.strip()
    for chunk in chunk_document(text, ChunkingStrategy(ChunkingKind.MARKDOWN, 16, 4)):
        assert text[chunk.start : chunk.end] == chunk.text
