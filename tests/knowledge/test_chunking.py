"""Chunking strategies: exact spans, sizes, overlap, coverage and heading paths, on any text."""

from __future__ import annotations

import itertools
import random
import unicodedata
from pathlib import Path

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokensvc.api.status import status_for
from tokensvc.errors import InvalidArgument
from tokensvc.knowledge import Chunk, ChunkingKind, ChunkingStrategy, chunk_document
from tokensvc.knowledge.chunking import MAX_WORD_CHARS

HANDBOOK = (Path(__file__).parent / "fixtures" / "handbook.md").read_text(encoding="utf-8")
TITLE = "Platform Engineering Handbook"

# --- generated documents -------------------------------------------------------------------------

_LETTERS = st.characters(
    codec="utf-8", exclude_categories=("Cs", "Zs", "Zl", "Zp", "Cc"), exclude_characters="#`~"
)
_COMBINING = st.sampled_from(["\u0301", "\u0308", "\u20dd", "\u0e31"])
_EMOJI = st.sampled_from(
    ["\U0001f600", "\U0001f44d\U0001f3fd", "\U0001f468\u200d\U0001f469\u200d\U0001f467", "\u2764\ufe0f"]
)
_UNIT = st.one_of(_LETTERS, _COMBINING, _EMOJI)  # one code point, or an emoji sequence
_WORD = st.lists(_UNIT, min_size=1, max_size=12).map("".join)
_SHORT_WORD = st.lists(_UNIT, min_size=1, max_size=8).map("".join)  # < MAX_WORD_CHARS
_SEPARATORS = st.sampled_from(
    [" ", " ", " ", "  ", "\n", "\n\n", "\r\n", "\r\n\r\n", "\r", "\t", "\u3000", "\xa0", "\n \n"]
)
_MARKUP = st.sampled_from(
    ["\n# Title\n", "\n## Sub ##\n", "\n### Deeper\n", "\n```\n", "\n~~~~\n", "\n    # code\n", "#tag", "."]
)
_LONG_WORD = st.text(_LETTERS, min_size=MAX_WORD_CHARS, max_size=400)


def _document(token: st.SearchStrategy[str], separators: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    pieces = st.lists(st.tuples(token, separators), max_size=300)
    return pieces.map(lambda pairs: "".join(word + sep for word, sep in pairs))


# Any text at all (whitespace-only, unspaced, control characters), and structured text.
ANY_TEXT = st.one_of(
    st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=3000),
    _document(st.one_of(_WORD, _WORD.map(lambda w: w + "."), _LONG_WORD, _MARKUP), _SEPARATORS),
    st.text(st.sampled_from(" \t\n\r\u3000\xa0\u2028"), max_size=200),
)
# Words short enough that the chunker's word is exactly a `str.split()` word.
PLAIN_WORDS_TEXT = _document(_SHORT_WORD, _SEPARATORS)


@st.composite
def strategies(draw: st.DrawFn, kinds: tuple[ChunkingKind, ...] = tuple(ChunkingKind)) -> ChunkingStrategy:
    size = draw(st.integers(16, 48))
    return ChunkingStrategy(draw(st.sampled_from(kinds)), size, draw(st.integers(0, (size - 1) // 2)))


def assert_chunk_invariants(text: str, chunks: list[Chunk], strategy: ChunkingStrategy) -> None:
    assert [c.index for c in chunks] == list(range(len(chunks)))
    covered = bytearray(len(text))
    for chunk in chunks:
        assert text[chunk.start : chunk.end] == chunk.text
        assert chunk.text.strip() == chunk.text != ""
        assert len(chunk.text.split()) <= strategy.chunk_size
        covered[chunk.start : chunk.end] = b"\x01" * (chunk.end - chunk.start)
        if strategy.kind is not ChunkingKind.MARKDOWN:
            assert chunk.heading_path == ()
    uncovered = [i for i, char in enumerate(text) if not char.isspace() and not covered[i]]
    assert uncovered == []
    for before, after in itertools.pairwise(chunks):
        assert before.start < after.start
        assert before.end < after.end
        shared = text[after.start : before.end] if after.start < before.end else ""
        assert len(shared.split()) <= strategy.chunk_overlap


# --- properties of every strategy --------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(text=ANY_TEXT, strategy=strategies())
def test_chunks_slice_exactly_cover_everything_and_respect_size_and_overlap(
    text: str, strategy: ChunkingStrategy
) -> None:
    assert_chunk_invariants(text, chunk_document(text, strategy), strategy)


@settings(max_examples=200, deadline=None)
@given(text=PLAIN_WORDS_TEXT, strategy=strategies((ChunkingKind.FIXED,)))
def test_fixed_windows_have_exactly_size_words_and_share_exactly_overlap_words(
    text: str, strategy: ChunkingStrategy
) -> None:
    chunks = chunk_document(text, strategy)
    words = text.split()
    assert [c.text.split() for c in chunks] == [
        words[i : i + strategy.chunk_size]
        for i in range(
            0, max(len(words) - strategy.chunk_overlap, 1), strategy.chunk_size - strategy.chunk_overlap
        )
    ][: len(chunks)]
    for before, after in itertools.pairwise(chunks):
        assert len(before.text.split()) == strategy.chunk_size
        assert len(text[after.start : before.end].split()) == strategy.chunk_overlap
    if words:
        assert chunks[-1].end == len(text.rstrip())


@pytest.mark.parametrize("kind", list(ChunkingKind))
@pytest.mark.parametrize("text", ["", " ", "\n\n\r\n\t", "\u3000\xa0\u2028"])
def test_empty_or_whitespace_text_has_no_chunks(kind: ChunkingKind, text: str) -> None:
    assert chunk_document(text, ChunkingStrategy(kind, 16, 4)) == []


@pytest.mark.parametrize("kind", list(ChunkingKind))
def test_text_without_spaces_is_cut_into_bounded_words_between_graphemes(kind: ChunkingKind) -> None:
    text = "e\u0301" * 3000 + "\U0001f468\u200d\U0001f469\u200d\U0001f467" * 500
    strategy = ChunkingStrategy(kind, 16, 2)
    chunks = chunk_document(text, strategy)
    assert_chunk_invariants(text, chunks, strategy)
    assert len(chunks) > 1
    assert max(len(c.text) for c in chunks) <= 16 * MAX_WORD_CHARS
    for chunk in chunks:
        # A chunk never opens with a mark, a joiner or the person a joiner attaches.
        assert unicodedata.category(chunk.text[0]) != "Mn"
        assert chunk.text[0] != "\u200d"
        assert chunk.start == 0 or text[chunk.start - 1] != "\u200d"


def test_five_megabyte_document_chunks_with_every_strategy() -> None:
    rng = random.Random(5)
    vocabulary = ["deploy", "rollback.", "canary", "pipeline,", "incident!", "owner", "schema?", "x" * 90]
    separators = [" "] * 12 + ["\n", "\n\n", "\n## Section\n\n"]
    text = "".join(rng.choice(vocabulary) + rng.choice(separators) for _ in range(600_000))
    assert len(text) > 5_000_000
    for kind in ChunkingKind:
        chunks = chunk_document(text, ChunkingStrategy(kind, 256, 32))
        assert chunks[0].start == 0
        assert chunks[-1].end == len(text.rstrip())


# --- recursive -------------------------------------------------------------------------------------


def test_recursive_keeps_paragraphs_that_fit_whole() -> None:
    paragraphs = [" ".join(f"p{p}w{w}" for w in range(10)) + "." for p in range(12)]
    text = "\n\n".join(paragraphs)
    chunks = chunk_document(text, ChunkingStrategy(ChunkingKind.RECURSIVE, 32, 0))
    assert [c.text for c in chunks] == ["\n\n".join(paragraphs[i : i + 3]) for i in range(0, 12, 3)]


def test_a_heading_is_not_left_alone_when_its_paragraph_does_not_fit_beside_it() -> None:
    sentences = [" ".join(f"s{s}w{w}" for w in range(5)) + "." for s in range(4)]
    text = "# Title\n\n" + " ".join(sentences)
    chunks = chunk_document(text, ChunkingStrategy(ChunkingKind.MARKDOWN, 16, 0))
    assert [c.text for c in chunks] == ["# Title\n\n" + " ".join(sentences[:2]), " ".join(sentences[2:])]


def test_recursive_splits_long_paragraphs_at_sentence_ends() -> None:
    sentences = [" ".join(f"s{s}w{w}" for w in range(7)) + "." for s in range(20)]
    text = " ".join(sentences)  # one paragraph of 140 words
    chunks = chunk_document(text, ChunkingStrategy(ChunkingKind.RECURSIVE, 30, 0))
    assert [c.text for c in chunks] == [" ".join(sentences[i : i + 4]) for i in range(0, 20, 4)]


def test_recursive_overlap_starts_at_a_sentence_when_one_is_in_reach() -> None:
    sentences = [" ".join(f"s{s}w{w}" for w in range(5)) + "." for s in range(12)]
    text = " ".join(sentences)
    chunks = chunk_document(text, ChunkingStrategy(ChunkingKind.RECURSIVE, 20, 7))
    for before, after in itertools.pairwise(chunks):
        shared = text[after.start : before.end]
        assert len(shared.split()) == 5  # one whole sentence: the 7-word window holds one start
        assert after.text.startswith(sentences[int(after.text[1 : after.text.index("w")])])


def test_recursive_overlap_falls_back_to_exact_words_inside_a_long_sentence() -> None:
    text = " ".join(f"w{i}" for i in range(100))
    chunks = chunk_document(text, ChunkingStrategy(ChunkingKind.RECURSIVE, 20, 6))
    for before, after in itertools.pairwise(chunks):
        assert text[after.start : before.end].split() == before.text.split()[-6:]


def test_recursive_treats_crlf_blank_lines_as_paragraph_breaks() -> None:
    first = " ".join(f"a{i}" for i in range(12))
    second = " ".join(f"b{i}" for i in range(12))
    text = f"{first}\r\n\r\n{second}\r\n"
    chunks = chunk_document(text, ChunkingStrategy(ChunkingKind.RECURSIVE, 16, 0))
    assert [c.text for c in chunks] == [first, second]


def test_numbered_list_markers_do_not_end_sentences() -> None:
    items = "\n".join(f"{n}. step {n} does one thing" for n in range(1, 9))
    chunks = chunk_document(items, ChunkingStrategy(ChunkingKind.RECURSIVE, 16, 0))
    assert all(not c.text.endswith(".") for c in chunks)
    assert all(c.text[0].isdigit() for c in chunks)


# --- markdown ----------------------------------------------------------------------------------------

HANDBOOK_SECTIONS = [
    (),
    ("Working Agreements",),
    ("Working Agreements", "Communication"),
    ("Working Agreements", "Meetings"),
    ("Working Agreements", "Ownership"),
    ("Onboarding",),
    ("Onboarding", "Your First Week"),
    ("Onboarding", "Your First Month"),
    ("Development Workflow",),
    ("Development Workflow", "Branching"),
    ("Development Workflow", "Code Review"),
    ("Development Workflow", "Commit Messages"),
    ("Testing",),
    ("Testing", "Unit and Integration Tests"),
    ("Testing", "Running the Suite"),
    ("Testing", "Flaky Tests"),
    ("Deploys",),
    ("Deploys", "Pipeline"),
    ("Deploys", "Canary Analysis"),
    ("Deploys", "Rollbacks"),
    ("Deploys", "Freeze Windows"),
    ("Incident Response",),
    ("Incident Response", "Severity Levels"),
    ("Incident Response", "Roles"),
    ("Incident Response", "Paging"),
    ("Incident Response", "Postmortems"),
    ("On-call",),
    ("On-call", "Before Your Shift"),
    ("On-call", "During Your Shift"),
    ("On-call", "Handover"),
    ("Observability",),
    ("Observability", "Logs"),
    ("Observability", "Metrics"),
    ("Observability", "Tracing"),
    ("Security",),
    ("Security", "Secrets"),
    ("Security", "Access Reviews"),
    ("Security", "Dependencies"),
    ("Data",),
    ("Data", "Schema Migrations"),
    ("Data", "Backups and Restores"),
    ("Data", "Retention and Deletion"),
    # `## Appendix` has no text of its own: its heading opens the Glossary's first chunk.
    ("Appendix", "Glossary"),
    ("Appendix", "Useful Commands"),
    ("Appendix", "Changes to This Handbook"),
]


def chunk_containing(chunks: list[Chunk], phrase: str) -> Chunk:
    return next(c for c in chunks if phrase in " ".join(c.text.split()))


@pytest.mark.parametrize(("size", "overlap"), [(16, 0), (64, 8), (256, 32), (2048, 0)])
def test_handbook_sections_carry_their_heading_paths_in_document_order(size: int, overlap: int) -> None:
    strategy = ChunkingStrategy(ChunkingKind.MARKDOWN, size, overlap)
    chunks = chunk_document(HANDBOOK, strategy)
    assert_chunk_invariants(HANDBOOK, chunks, strategy)
    assert len(HANDBOOK.split()) > 3000
    paths = list(dict.fromkeys(c.heading_path for c in chunks))
    assert paths == [(TITLE, *path) for path in HANDBOOK_SECTIONS]
    for path in paths:
        first = next(c for c in chunks if c.heading_path == path)
        assert first.text.startswith("#")  # the heading line opens its section's first chunk
        assert f"# {path[-1]}" in first.text


def test_handbook_passages_are_found_under_the_right_section() -> None:
    chunks = chunk_document(HANDBOOK, ChunkingStrategy(ChunkingKind.MARKDOWN, 64, 8))
    expected = {
        "Any engineer may roll back any deploy at any time": ("Deploys", "Rollbacks"),
        "deployctl rollback tokensvc --to previous": ("Deploys", "Rollbacks"),
        "| SEV2 | A major feature is broken for many users": ("Incident Response", "Severity Levels"),
        "The postmortem is blameless": ("Incident Response", "Postmortems"),
        "return path.read_text(encoding=": ("Security", "Secrets"),
        "Tuesday mornings, not on Mondays": ("On-call",),
        "This handbook describes how the platform engineering group": (),
    }
    for phrase, path in expected.items():
        assert chunk_containing(chunks, phrase).heading_path == (TITLE, *path), phrase


def test_hash_lines_inside_code_fences_are_not_headings() -> None:
    chunks = chunk_document(HANDBOOK, ChunkingStrategy(ChunkingKind.MARKDOWN, 256, 0))
    titles = {title for c in chunks for title in c.heading_path}
    assert not any("hash" in title or "comment" in title or "create" in title for title in titles)
    assert chunk_containing(chunks, "inside a tilde fence").heading_path == (
        TITLE,
        "Data",
        "Schema Migrations",
    )
    text = (
        "# Top\n\nintro\n\n````md\n```\n# inside\n```\n````\n\n~~~\n## also inside\n~~~\n\n## Next\n\nbody\n"
    )
    chunks = chunk_document(text, ChunkingStrategy(ChunkingKind.MARKDOWN, 16, 0))
    assert [c.heading_path for c in chunks] == [("Top",), ("Top", "Next")]


def test_markdown_offsets_index_crlf_documents_unchanged() -> None:
    text = HANDBOOK.replace("\n", "\r\n")
    strategy = ChunkingStrategy(ChunkingKind.MARKDOWN, 64, 8)
    chunks = chunk_document(text, strategy)
    assert_chunk_invariants(text, chunks, strategy)
    plain = chunk_document(HANDBOOK, strategy)
    assert [c.heading_path for c in chunks] == [c.heading_path for c in plain]
    assert [c.text.split() for c in chunks] == [c.text.split() for c in plain]


def test_markdown_heading_syntax_edge_cases() -> None:
    text = (
        "Preamble text.\n"
        "# Guide #\n\nalpha\n"
        "#hashtag is not a heading\n"
        "    # indented code is not a heading\n"
        "#\n\nan empty heading carries no title\n"
        "### Skipped Level\n\nbeta\n"
        "## Sibling\n"
        "## Other ##   \n\ngamma\n"
        "####### seven hashes is text\n"
        "# Second\r\n\r\ndelta"
    )
    chunks = chunk_document(text, ChunkingStrategy(ChunkingKind.MARKDOWN, 32, 0))
    assert [(c.heading_path, c.text) for c in chunks] == [
        ((), "Preamble text."),
        (
            ("Guide",),
            "# Guide #\n\nalpha\n#hashtag is not a heading\n    # indented code is not a heading\n"
            "#\n\nan empty heading carries no title",
        ),
        (("Guide", "Skipped Level"), "### Skipped Level\n\nbeta"),
        # A title-only section before a sibling stays a chunk of its own, so its title is findable.
        (("Guide", "Sibling"), "## Sibling"),
        (("Guide", "Other"), "## Other ##   \n\ngamma\n####### seven hashes is text"),
        (("Second",), "# Second\r\n\r\ndelta"),
    ]


def test_markdown_overlap_stays_within_a_section() -> None:
    body = " ".join(f"w{i}" for i in range(40))
    text = f"# A\n\n{body}\n\n# B\n\n{body}\n"
    chunks = chunk_document(text, ChunkingStrategy(ChunkingKind.MARKDOWN, 16, 6))
    first_b = next(c for c in chunks if c.heading_path == ("B",))
    last_a = [c for c in chunks if c.heading_path == ("A",)][-1]
    assert first_b.start > last_a.end
    assert first_b.text.startswith("# B")


def test_an_unclosed_fence_runs_to_the_end() -> None:
    text = "# Top\n\nintro\n\n```\n# not a heading\n\nmore code"
    chunks = chunk_document(text, ChunkingStrategy(ChunkingKind.MARKDOWN, 16, 0))
    assert {c.heading_path for c in chunks} == {("Top",)}


# --- strategy validation ----------------------------------------------------------------------------


def test_from_request_applies_the_documented_defaults() -> None:
    assert ChunkingStrategy.from_request(ChunkingKind.FIXED) == ChunkingStrategy(ChunkingKind.FIXED, 256, 0)
    assert ChunkingStrategy.from_request("Markdown", 0, 100) == ChunkingStrategy(
        ChunkingKind.MARKDOWN, 256, 100
    )
    assert ChunkingStrategy.from_request("recursive", 16, 7).chunk_overlap == 7
    assert ChunkingStrategy.from_request("recursive", 2048, 1023).chunk_size == 2048
    assert ChunkingStrategy.from_stored("markdown", 64, 8) == ChunkingStrategy(ChunkingKind.MARKDOWN, 64, 8)


@pytest.mark.parametrize(
    ("kind", "size", "overlap", "field"),
    [
        ("fixed", 15, 0, "chunking.chunk_size"),
        ("fixed", 2049, 0, "chunking.chunk_size"),
        ("fixed", -1, 0, "chunking.chunk_size"),
        ("fixed", 16, 8, "chunking.chunk_overlap"),
        ("recursive", 0, 128, "chunking.chunk_overlap"),
        ("markdown", 100, -1, "chunking.chunk_overlap"),
        ("sentences", 100, 0, "chunking.kind"),
        ("", 100, 0, "chunking.kind"),
    ],
)
def test_bad_strategy_parameters_are_invalid_argument_naming_the_field(
    kind: str, size: int, overlap: int, field: str
) -> None:
    with pytest.raises(InvalidArgument) as caught:
        ChunkingStrategy.from_request(kind, size, overlap)
    assert caught.value.field == field
    assert status_for(caught.value).code is grpc.StatusCode.INVALID_ARGUMENT


def test_validation_uses_the_callers_field_path() -> None:
    with pytest.raises(InvalidArgument) as caught:
        ChunkingStrategy.from_request("fixed", 8, 0, field="knowledge_base.chunking")
    assert caught.value.field == "knowledge_base.chunking.chunk_size"


def test_chunk_document_refuses_an_invalid_strategy() -> None:
    with pytest.raises(InvalidArgument) as caught:
        chunk_document("some text", ChunkingStrategy(ChunkingKind.FIXED, 16, 8))
    assert caught.value.field == "chunking.chunk_overlap"
