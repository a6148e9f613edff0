"""`text/csv`, and the rendering of table rows as records that CSV and XLSX share.

A table's rows become records, one line each (`\\n` between lines):

- the header is the table's first non-empty row, except that a row with a single non-empty cell
  followed by a row with more (a title above the header, often a merged cell) is a title line;
- each later non-empty row is `Header: value; Header2: value`, its empty cells skipped; a header
  cell that is empty is named by its column letter (`C`), as is a cell beyond the header's width;
- a title line, or a table's only row, is its non-empty cells joined by ` | `;
- every cell's whitespace (line breaks included) collapses to one space; a line Markdown would
  read as a heading or a code fence gets a backslash in front. Empty rows add nothing.

Each line is a `SourceSpan` with the table's sheet name and the row's number as its file numbers
it (1-based; for CSV the record number, the header's is 1, and a quoted field's line breaks do not
count). The header row adds no line of its own: its names are in every record.

`text/csv`: UTF-8 (a leading byte-order mark dropped), quotes as Excel writes them, the delimiter
one of `,` `;` tab `|`: the one that splits most of the first 100 rows (of the first 64 KiB) into
rows of one width over one field (`,` when none does). Its text is its
records as above (sheet name empty, no heading). Refused: not UTF-8, a field over Python's `csv`
field limit (128 KiB) or other malformed CSV ("is not a valid CSV file"), and more rows or cells
than `ExtractionLimits.max_rows` / `max_cells` (`PayloadTooLarge`).
"""

from __future__ import annotations

import csv
import io
import itertools
from collections import Counter
from collections.abc import Sequence

from tokensvc.knowledge.formats.builder import TextBuilder, markdown_line
from tokensvc.knowledge.formats.documents import ExtractedDocument, ExtractionLimits
from tokensvc.knowledge.formats.refusals import over_limit, unreadable_as
from tokensvc.knowledge.formats.text import decoded_text

__all__ = ["RecordTable", "RowBudget", "column_letter", "csv_document"]

_SNIFF_CHARS = 64 * 1024
_SNIFF_ROWS = 100
_DELIMITERS = ",;\t|"


class RowBudget:
    """Counts a document's rows and cells against `ExtractionLimits.max_rows` and `max_cells`."""

    def __init__(self, limits: ExtractionLimits) -> None:
        self._limits = limits
        self._rows = 0
        self._cells = 0

    def take(self, cells: int) -> None:
        self._rows += 1
        self._cells += cells
        if self._rows > self._limits.max_rows:
            raise over_limit(f"over {self._limits.max_rows:,}", "rows", self._limits.max_rows)
        if self._cells > self._limits.max_cells:
            raise over_limit(f"over {self._limits.max_cells:,}", "cells", self._limits.max_cells)


class RecordTable:
    """Renders one table's rows as records into `builder` (see the module docstring); `heading`
    (a sheet's name) opens the table's text as `# heading`, when the table has any text."""

    def __init__(self, builder: TextBuilder, sheet: str = "", heading: str = "") -> None:
        self._builder = builder
        self._sheet = sheet
        self._heading = heading
        self._started = False
        self._header: list[str] | None = None
        self._pending: tuple[int, list[str]] | None = None  # the header, unless a title

    def row(self, number: int, values: Sequence[str]) -> None:
        cells = [" ".join(value.split()) for value in values]
        filled = sum(1 for cell in cells if cell)
        if not filled:
            return
        if self._header is None:
            if self._pending is None:
                self._pending = (number, cells)
                return
            if sum(1 for cell in self._pending[1] if cell) == 1 and filled > 1:
                self._line(self._pending[0], " | ".join(cell for cell in self._pending[1] if cell))
                self._pending = (number, cells)
                return
            self._header = [name or column_letter(i) for i, name in enumerate(self._pending[1])]
            self._pending = None
        names = self._header
        fields = (
            f"{names[i] if i < len(names) else column_letter(i)}: {cell}"
            for i, cell in enumerate(cells)
            if cell
        )
        self._line(number, "; ".join(fields))

    def finish(self) -> None:
        """A table of one non-empty row shows it (it has no records to name its cells in)."""
        if self._pending is not None:
            self._line(self._pending[0], " | ".join(cell for cell in self._pending[1] if cell))
            self._pending = None

    def _line(self, number: int, line: str) -> None:
        separator = "\n"
        if not self._started:
            self._started = True
            separator = "\n\n"
            if self._heading:
                self._builder.add("# " + " ".join(self._heading.split()), sheet=self._sheet)
        self._builder.add(markdown_line(line), separator, sheet=self._sheet, row=number)


def column_letter(index: int) -> str:
    """The spreadsheet letter of the 0-based column `index`: A, B, ..., Z, AA, AB..."""
    letters = ""
    index += 1
    while index:
        index, remainder = divmod(index - 1, 26)
        letters = chr(ord("A") + remainder) + letters
    return letters


def csv_document(content: bytes, limits: ExtractionLimits) -> ExtractedDocument:
    """The records of the CSV `content` (see the module docstring)."""
    text = decoded_text(content)
    builder, budget = TextBuilder(), RowBudget(limits)
    table = RecordTable(builder)
    with unreadable_as("CSV"):
        reader = csv.reader(io.StringIO(text, newline=""), delimiter=_delimiter(text))
        for number, values in enumerate(reader, 1):
            budget.take(len(values))
            table.row(number, values)
    table.finish()
    return builder.document("text/csv")


def _delimiter(text: str) -> str:
    """The candidate that splits the first rows into the most rows of one width (over one)."""
    sample = text[:_SNIFF_CHARS]
    best, best_score = ",", (0, 0)
    for candidate in _DELIMITERS:
        try:
            rows = csv.reader(io.StringIO(sample, newline=""), delimiter=candidate)
            widths = Counter(len(row) for row in itertools.islice(rows, _SNIFF_ROWS) if row)
        except csv.Error:
            continue
        width, count = widths.most_common(1)[0] if widths else (0, 0)
        if width > 1 and (count, width) > best_score:
            best, best_score = candidate, (count, width)
    return best
