"""Chunking strategies: split a document's extracted text into cited, exactly addressable chunks.

The contract is `ChunkingStrategy` in `protos/tokensvc/v1/knowledge.proto`. Every chunk is an exact
span of the text it was cut from: `text[chunk.start:chunk.end] == chunk.text` (Unicode code
points, end exclusive), so a citation's offsets always slice its passage out of the document.
Chunks never start or end in whitespace, never are only whitespace, are indexed 0..n-1 in
document order, and together cover every non-whitespace character of the document.

Sizes are counted in *words*: maximal runs of non-whitespace (Python's `str.isspace`), except that
a run longer than `MAX_WORD_CHARS` code points (a URL, a base64 blob, text without spaces) counts
as several words of at most that length, cut between grapheme-like units where possible. So no
chunk exceeds `chunk_size` words, and no chunk's text grows without bound on unspaced input.

- `fixed`: windows of `chunk_size` words; consecutive windows share exactly `chunk_overlap` words.
- `recursive`: a paragraph (blank lines end one) is kept whole if it fits the open chunk, or the
  next one when the open chunk is at least half full; otherwise its sentences (terminal punctuation
  or a line break ends one; `3.` opening a line is a list marker, not an end) are packed, and a
  sentence longer than a chunk is packed word by word. A new chunk repeats at most `chunk_overlap`
  words of the previous one: from the first sentence start in that window, else exactly that many.
- `markdown`: sections start at ATX headings (`#`..`######`, not inside fenced code blocks;
  front matter is not special); each section is chunked recursively (overlap stays within a
  section) and every chunk carries the section's heading path. The heading line opens its
  section's first chunk, so searching for a title finds it; a heading whose section has no body of
  its own and is followed by a deeper heading joins that subsection's first chunk. Empty headings
  (`#` alone) and setext headings are not recognised.

Line breaks are `\n`, `\r\n` or `\r`: text/plain and text/markdown documents are chunked exactly
as uploaded (the proto promises their offsets index the decoded upload, nothing normalised).
Everything runs in time linear in the document's length.
"""

from __future__ import annotations

import re
import unicodedata
from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from itertools import pairwise

from tokensvc.errors import InvalidArgument

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "MAX_CHUNK_SIZE",
    "MAX_WORD_CHARS",
    "MIN_CHUNK_SIZE",
    "Chunk",
    "ChunkingKind",
    "ChunkingStrategy",
    "chunk_document",
]

MIN_CHUNK_SIZE = 16
MAX_CHUNK_SIZE = 2048
DEFAULT_CHUNK_SIZE = 256
MAX_WORD_CHARS = 64
# How far back from MAX_WORD_CHARS a cut may move to avoid splitting a mark from its base; bounded
# so adversarial input (thousands of combining marks) stays linear.
_CUT_SEARCH = 16


class ChunkingKind(StrEnum):
    FIXED = "fixed"
    RECURSIVE = "recursive"
    MARKDOWN = "markdown"


@dataclass(frozen=True)
class ChunkingStrategy:
    """A knowledge base's pinned chunking strategy, defaults filled in (so equality means "same")."""

    kind: ChunkingKind
    chunk_size: int = DEFAULT_CHUNK_SIZE
    chunk_overlap: int = 0

    @classmethod
    def from_request(
        cls, kind: ChunkingKind | str, chunk_size: int = 0, chunk_overlap: int = 0, *, field: str = "chunking"
    ) -> ChunkingStrategy:
        """Apply the proto's defaults (size 0 means 256) and validate; errors name `field.*`."""
        try:
            parsed = ChunkingKind(kind.lower())
        except ValueError:
            choices = ", ".join(k.value for k in ChunkingKind)
            raise InvalidArgument(f"{field}.kind", f"must be one of {choices}") from None
        strategy = cls(parsed, chunk_size or DEFAULT_CHUNK_SIZE, chunk_overlap)
        strategy.validate(field)
        return strategy

    @classmethod
    def from_stored(cls, kind: str, chunk_size: int, chunk_overlap: int) -> ChunkingStrategy:
        """Rebuild a pinned strategy from its stored columns (validated when it was created)."""
        return cls(ChunkingKind(kind), chunk_size, chunk_overlap)

    def validate(self, field: str = "chunking") -> None:
        if not isinstance(self.kind, ChunkingKind):
            raise InvalidArgument(f"{field}.kind", "must be fixed, recursive or markdown")
        if not MIN_CHUNK_SIZE <= self.chunk_size <= MAX_CHUNK_SIZE:
            raise InvalidArgument(
                f"{field}.chunk_size",
                f"must be {MIN_CHUNK_SIZE} to {MAX_CHUNK_SIZE} words (0 means {DEFAULT_CHUNK_SIZE}),"
                f" got {self.chunk_size}",
            )
        if self.chunk_overlap < 0 or 2 * self.chunk_overlap >= self.chunk_size:
            raise InvalidArgument(
                f"{field}.chunk_overlap",
                f"must be at least 0 and less than half of chunk_size ({self.chunk_size}),"
                f" got {self.chunk_overlap}",
            )


@dataclass(frozen=True)
class Chunk:
    """One chunk: `document[start:end] == text` (code points, end exclusive)."""

    index: int
    text: str
    start: int
    end: int
    heading_path: tuple[str, ...] = ()


def chunk_document(text: str, strategy: ChunkingStrategy) -> list[Chunk]:
    """Split `text` with `strategy`; an empty or whitespace-only text has no chunks."""
    strategy.validate()
    words = _Words(text)
    size, overlap = strategy.chunk_size, strategy.chunk_overlap
    spans: Iterator[tuple[int, int, tuple[str, ...]]]
    if strategy.kind is ChunkingKind.FIXED:
        spans = ((a, b, ()) for a, b in _fixed(len(words.starts), size, overlap))
    elif strategy.kind is ChunkingKind.RECURSIVE:
        spans = ((a, b, ()) for a, b in _recursive(words, 0, len(words.starts), size, overlap))
    else:
        spans = _markdown(text, words, size, overlap)
    chunks = []
    for index, (first, last, path) in enumerate(spans):
        start, end = words.starts[first], words.ends[last - 1]
        chunks.append(Chunk(index, text[start:end], start, end, path))
    return chunks


# --- words and the boundaries between them -------------------------------------------------------

_GAP_AND_RUN = re.compile(r"(\s*)(\S+)")
_LINE_BREAK = re.compile(r"\r\n|\r|\n")
# Closing quotes and brackets may follow a sentence's terminal punctuation: `He said "go."`.
# Escapes: closing guillemets, curly quotes and CJK brackets; ellipsis, CJK and fullwidth stops.
_CLOSERS = "\"')]}\u00bb\u201d\u2019\u203a\u300d\u300f"
_TERMINALS = frozenset(".!?\u2026\u3002\uff01\uff1f\u203c\u2047\u2048\u2049")
_SENTENCE_TAIL = frozenset(_CLOSERS) | _TERMINALS

_LIST_MARKER = re.compile(r"\d{1,9}[.)]")

WORD, SENTENCE, PARAGRAPH = 0, 1, 2


class _Words:
    """Word spans of a text and, per word, the strongest boundary in the gap before it."""

    def __init__(self, text: str) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        # breaks[i]: PARAGRAPH (a blank line), SENTENCE (a line break or terminal punctuation before
        # word i) or WORD. breaks[0] is PARAGRAPH: the text's start opens everything.
        self.breaks = bytearray()
        starts, ends, breaks = self.starts, self.ends, self.breaks  # hot loop: local names
        previous_start = previous_end = 0
        previous_opens_line = False
        for match in _GAP_AND_RUN.finditer(text):
            gap = match.group(1)
            start, end = match.span(2)
            # `\r\n` is one line break; counting beats a regex on millions of gaps.
            if "\n" in gap or "\r" in gap:
                line_breaks = gap.count("\n") + gap.count("\r") - gap.count("\r\n")
            else:
                line_breaks = 0
            if not starts or line_breaks >= 2:
                level = PARAGRAPH
            elif line_breaks or (
                text[previous_end - 1] in _SENTENCE_TAIL
                and _ends_sentence(text, previous_start, previous_end)
                # `3.` opening a line numbers a list item; it ends no sentence.
                and not (previous_opens_line and _LIST_MARKER.fullmatch(text, previous_start, previous_end))
            ):
                level = SENTENCE
            else:
                level = WORD
            previous_opens_line = not starts or line_breaks > 0
            if end - start <= MAX_WORD_CHARS:
                starts.append(start)
                ends.append(end)
                breaks.append(level)
            else:
                for cut_start, cut_end in _cut_long_run(text, start, end):
                    starts.append(cut_start)
                    ends.append(cut_end)
                    breaks.append(level)
                    level = WORD
            previous_start, previous_end = start, end


def _ends_sentence(text: str, start: int, end: int) -> bool:
    """Whether the word text[start:end] ends a sentence (terminal punctuation, maybe closers)."""
    while end > start and text[end - 1] in _CLOSERS:
        end -= 1
    return end > start and text[end - 1] in _TERMINALS


def _cut_long_run(text: str, start: int, end: int) -> Iterator[tuple[int, int]]:
    while end - start > MAX_WORD_CHARS:
        cut = start + MAX_WORD_CHARS
        for candidate in range(cut, cut - _CUT_SEARCH, -1):
            if not _joins_previous(text[candidate]) and text[candidate - 1] != "\u200d":
                cut = candidate
                break
        yield start, cut
        start = cut
    yield start, end


def _joins_previous(char: str) -> bool:
    """Whether `char` belongs to the grapheme before it (marks, variation selectors, emoji tags)."""
    code = ord(char)
    return (
        unicodedata.category(char) in ("Mn", "Mc", "Me")
        or char == "\u200d"
        or 0xFE00 <= code <= 0xFE0F
        or 0x1F3FB <= code <= 0x1F3FF
        or 0xE0020 <= code <= 0xE007F
    )


# --- fixed and recursive -------------------------------------------------------------------------


def _fixed(count: int, size: int, overlap: int) -> Iterator[tuple[int, int]]:
    step = size - overlap
    first = 0
    while first < count:
        yield first, min(first + size, count)
        if first + size >= count:
            return
        first += step


def _split(breaks: bytearray, lo: int, hi: int, level: int) -> Iterator[tuple[int, int]]:
    start = lo
    for i in range(lo + 1, hi):
        if breaks[i] >= level:
            yield start, i
            start = i
    if start < hi:
        yield start, hi


def _recursive(words: _Words, lo: int, hi: int, size: int, overlap: int) -> list[tuple[int, int]]:
    """Pack the paragraphs, sentences or words of [lo, hi) into chunks of at most `size` words."""
    packer = _Packer(words.breaks, lo, size, overlap)
    for p_lo, p_hi in _split(words.breaks, lo, hi, PARAGRAPH):
        # A paragraph stays whole if it fits this chunk, or the next one when this one is at least
        # half full; otherwise its sentences fill this chunk (no heading-only or sliver chunks).
        if packer.fits(p_hi) or (p_hi - p_lo <= size and packer.half_full()):
            packer.add(p_hi)
            continue
        for s_lo, s_hi in _split(words.breaks, p_lo, p_hi, SENTENCE):
            if s_hi - s_lo <= size:
                packer.add(s_hi)
            else:
                for word_end in range(s_lo + 1, s_hi + 1):
                    packer.add(word_end)
    return packer.finish()


class _Packer:
    """Greedily packs consecutive pieces, each given by its end (word index), into chunks."""

    def __init__(self, breaks: bytearray, lo: int, size: int, overlap: int) -> None:
        self.breaks, self.size, self.overlap = breaks, size, overlap
        self.first = self.end = lo  # the open chunk is words [first, end)
        self.chunks: list[tuple[int, int]] = []

    def fits(self, piece_end: int) -> bool:
        return piece_end - self.first <= self.size

    def half_full(self) -> bool:
        return 2 * (self.end - self.first) >= self.size

    def add(self, piece_end: int) -> None:
        """Append the piece ending at `piece_end` (at most `size` words), closing the chunk first."""
        if self.end > self.first and not self.fits(piece_end):
            self.chunks.append((self.first, self.end))
            self.first = _overlap_start(self.breaks, self.first, self.end, piece_end, self.size, self.overlap)
        self.end = piece_end

    def finish(self) -> list[tuple[int, int]]:
        if self.end > self.first:
            self.chunks.append((self.first, self.end))
        return self.chunks


def _overlap_start(breaks: bytearray, first: int, end: int, piece_end: int, size: int, overlap: int) -> int:
    """Where the chunk after [first, end) starts so that it still fits the next piece.

    At most `overlap` words are repeated, never the whole previous chunk (so every chunk brings new
    text). A sentence start keeps the repeated text readable; without one, the overlap is exact.
    """
    lowest = max(end - overlap, piece_end - size, first + 1)
    for i in range(lowest, end):
        if breaks[i] >= SENTENCE:
            return i
    return lowest


# --- markdown --------------------------------------------------------------------------------------

_ATX = re.compile(r" {0,3}(#{1,6})(?:[ \t]+(.*))?[ \t]*$", re.DOTALL)
_ATX_CLOSING = re.compile(r"(?:^|[ \t]+)#+[ \t]*$")
_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})(.*)$", re.DOTALL)


def _lines(text: str) -> Iterator[tuple[int, int, str]]:
    """Yield (start, end of content, content) for every line, without its line break."""
    start = 0
    for match in _LINE_BREAK.finditer(text):
        yield start, match.start(), text[start : match.start()]
        start = match.end()
    yield start, len(text), text[start:]


def _headings(text: str) -> Iterator[tuple[int, int, int, str]]:
    """Yield (line start, line end, level, title) for each ATX heading outside fenced code."""
    fence = ""  # the open fence's marker run, or "" outside fenced code
    for start, end, line in _lines(text):
        fenced = _FENCE.match(line)
        if fence:
            # A closing fence uses the same character, at least as many, and nothing after it.
            if fenced and fenced.group(1)[0] == fence[0] and len(fenced.group(1)) >= len(fence):
                fence = "" if not fenced.group(2).strip() else fence
            continue
        if fenced and not (fenced.group(1)[0] == "`" and "`" in fenced.group(2)):
            fence = fenced.group(1)
            continue
        heading = _ATX.match(line)
        if heading:
            title = _ATX_CLOSING.sub("", heading.group(2) or "").strip()
            if title:  # an empty heading (`#` alone) carries no title to put in a path
                yield start, end, len(heading.group(1)), title


def _markdown(
    text: str, words: _Words, size: int, overlap: int
) -> Iterator[tuple[int, int, tuple[str, ...]]]:
    # Sections as (first word, heading level, heading line end, path); the preamble has level 0.
    sections: list[tuple[int, int, int, tuple[str, ...]]] = [(0, 0, 0, ())]
    stack: list[tuple[int, str]] = []
    w = 0
    for line_start, line_end, level, title in _headings(text):
        while stack and stack[-1][0] >= level:
            stack.pop()
        stack.append((level, title))
        # Headings start at a line start, so no word straddles a section boundary.
        w = bisect_left(words.starts, line_start, w)
        sections.append((w, level, line_end, tuple(t for _, t in stack)))
    sections.append((len(words.starts), 0, 0, ()))

    lo = 0
    for (first, level, heading_end, path), (nxt, next_level, _, _) in pairwise(sections):
        body_is_empty = nxt == first or words.starts[nxt - 1] < heading_end
        if level and body_is_empty and next_level > level:
            continue  # a title-only section opens its first subsection's chunk
        for a, b in _recursive(words, lo, nxt, size, overlap):
            yield a, b, path
        lo = nxt
