"""The text formats: `text/plain` and `text/markdown` as uploaded, `text/html` as light Markdown.

- `text/plain`, `text/markdown`: the bytes decoded as UTF-8 with a leading byte-order mark
  removed and *nothing else changed* (not even `\\r\\n`): a client can slice its own file, decoded
  the same way, with the offsets it gets back. Markdown stays Markdown so the markdown chunker
  sees its headings.
- `text/html`: the readable text, rendered as light Markdown by BeautifulSoup over lxml's parser
  (linear time; `html.parser` is quadratic on input like `"<a" * n`):
  `script`, `style`, `noscript`, `template` and `head` are dropped; paragraphs and other blocks are
  separated by a blank line, list items, table rows and `<br>` by a line break, table cells by
  ` | `; `h1`..`h6` become `#`..`######` headings so the markdown chunker keeps heading paths for
  HTML too; `pre` keeps its text verbatim inside a code fence (so a `# comment` in it is no
  heading), but for runs of blank lines, which become one; other whitespace collapses to one
  space, and a text line that Markdown would read as a heading or a fence is escaped with a
  backslash. Line breaks are `\\n`.

Bytes that are not UTF-8 or text containing U+0000 (PostgreSQL cannot store it, so it is refused
before anything is stored) are `InvalidArgument` naming `content`.
"""

from __future__ import annotations

import re

from bs4 import BeautifulSoup
from bs4.element import Comment, Declaration, Doctype, NavigableString, ProcessingInstruction, Tag

from tokensvc.errors import InvalidArgument
from tokensvc.knowledge.formats.builder import markdown_line

__all__ = ["decoded_text", "html_text"]


def decoded_text(content: bytes) -> str:
    """The bytes as UTF-8 text, a leading byte-order mark removed, nothing else changed."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidArgument("content", f"is not valid UTF-8 (at byte {error.start})") from None
    text = text.removeprefix("\ufeff")
    if "\x00" in text:
        raise InvalidArgument("content", "contains U+0000 (NUL), which cannot be stored")
    return text


# --- HTML ---------------------------------------------------------------------------------------

_DROPPED = frozenset({"script", "style", "noscript", "template", "head"})
_BLOCKS = frozenset(
    {
        "address",
        "article",
        "aside",
        "blockquote",
        "body",
        "dd",
        "details",
        "dialog",
        "div",
        "dl",
        "dt",
        "fieldset",
        "figcaption",
        "figure",
        "footer",
        "form",
        "header",
        "hr",
        "html",
        "main",
        "nav",
        "ol",
        "p",
        "section",
        "summary",
        "table",
        "ul",
    }
)
_LINES = frozenset({"li", "tr", "caption", "thead", "tbody", "tfoot"})
_HEADINGS = {f"h{level}": level for level in range(1, 7)}
_CELLS = frozenset({"td", "th"})
_SKIPPED_STRINGS = (Comment, Declaration, Doctype, ProcessingInstruction)
_SPACE = re.compile(r"\s+")
_BACKTICKS = re.compile(r"`{3,}")
_BLANK_RUN = re.compile(r"\n(?:[ \t]*\n){2,}")

_BLANK, _NEWLINE = "\n\n", "\n"


class _Renderer:
    """Collects output as lines; breaks are requested, then applied once before the next text."""

    def __init__(self) -> None:
        self.out: list[str] = []
        self.line: list[str] = []
        self.pending = ""  # the strongest break requested since the last text: "", "\n" or "\n\n"

    def request(self, brk: str) -> None:
        if len(brk) > len(self.pending):
            self.pending = brk

    def text(self, value: str) -> None:
        value = _SPACE.sub(" ", value)
        if not value.strip():
            if self.line:
                self.line.append(" ")
            return
        self._flush_break()
        self.line.append(value)

    def block(self, value: str) -> None:
        """Emit `value` (a heading or a fenced pre) as whole lines of its own, then a blank line."""
        self.request(_BLANK)
        self._flush_break()
        self.out.append(value)
        self.pending = _BLANK

    def _flush_break(self) -> None:
        if self.pending:
            self._end_line()
            if self.out:
                self.out.append(self.pending)
            self.pending = ""

    def _end_line(self) -> None:
        line = _SPACE.sub(" ", "".join(self.line)).strip(" ")
        self.line = []
        if line:
            self.out.append(markdown_line(line))

    def result(self) -> str:
        self._end_line()
        return "".join(self.out)


def html_text(html: str) -> str:
    """HTML's readable text as light Markdown (see the module docstring)."""
    soup = BeautifulSoup(html, "lxml")
    # Dropped first, so that no heading's or pre's get_text() picks up a script inside it.
    for tag in soup.find_all(_DROPPED):
        tag.decompose()
    renderer = _Renderer()
    # An explicit stack, not recursion: deeply nested (or hostile) HTML cannot overflow it.
    # Entries are nodes to render, or a string: a break to request when an element closes.
    stack: list[object] = [soup]
    while stack:
        node = stack.pop()
        if isinstance(node, str) and not isinstance(node, NavigableString):
            renderer.request(node)
        elif isinstance(node, NavigableString):
            if not isinstance(node, _SKIPPED_STRINGS):
                renderer.text(str(node))
        elif isinstance(node, Tag):
            _enter(node, renderer, stack)
    return renderer.result()


def _enter(tag: Tag, renderer: _Renderer, stack: list[object]) -> None:
    """Render `tag` whole (headings, pre, br), or push its children and its closing break."""
    name = tag.name.lower()
    if name in _HEADINGS:
        title = _SPACE.sub(" ", tag.get_text()).strip()
        if title:
            renderer.block("#" * _HEADINGS[name] + " " + title)
    elif name == "pre":
        code = tag.get_text()
        if code.strip():
            renderer.block(_fenced(code))
    elif name == "br":
        renderer.request(_NEWLINE)
    else:
        brk = _BLANK if name in _BLOCKS else _NEWLINE if name in _LINES else ""
        if name in _CELLS and renderer.line and not renderer.pending:
            renderer.text(" | ")
        renderer.request(brk)
        if brk:
            stack.append(brk)
        stack.extend(reversed(tag.contents))


def _fenced(code: str) -> str:
    code = code.replace("\r\n", "\n").replace("\r", "\n").strip("\n")
    # One blank line at most, as everywhere else in the text: a run of them is no content.
    code = _BLANK_RUN.sub("\n\n", code)
    # The fence must be longer than any backtick run inside, or that run would close it.
    longest = max((len(run) for run in _BACKTICKS.findall(code)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}\n{code}\n{fence}"
