"""XLSX (`application/vnd.openxmlformats-officedocument.spreadsheetml.sheet`): each worksheet's
rows as records, read with openpyxl in read-only (streaming) mode after the archive check.

The extracted text is the worksheets' sections in workbook order, separated by a blank line
(`\\n\\n`). A sheet's section is `# <sheet name>` (a `SourceSpan` with the sheet's name), a blank
line, then its rows rendered as records (`records`: the first non-empty row is the header, a
later row is `Header: value; Header2: value`), each line a `SourceSpan(sheet=name, row=n)` with the
row's number in the sheet. A sheet without values adds nothing.

Values are shown as a spreadsheet shows them, without number formats: whole numbers without a
decimal point, other numbers as Python's shortest repr, `TRUE`/`FALSE`, dates as `2026-12-05`
(`2026-12-05 14:30:00` with a time). A formula is its value as last computed by the program that
saved the file; files written by libraries often have none, and the cell is then empty. Merged
cells hold their value in the top-left cell only. Chart sheets add nothing.

Limits: openpyxl's read-only reader stops at the row count a sheet declares; the declaration is
reset and our own `ExtractionLimits` bound the work instead (`max_sheets`; `max_rows` and
`max_cells` over all sheets, counting empty rows and the empty cells that pad a row to its last
value): `PayloadTooLarge` past any of them. openpyxl parses XML with defusedxml (installed with
tokensvc), which refuses entity expansion. See `archives` (bombs) and `refusals` ("is not a valid
XLSX file").
"""

from __future__ import annotations

import datetime
import io

import openpyxl
from openpyxl.worksheet._read_only import ReadOnlyWorksheet

from tokensvc.knowledge.formats.archives import check_archive
from tokensvc.knowledge.formats.builder import TextBuilder
from tokensvc.knowledge.formats.documents import ExtractedDocument, ExtractionLimits
from tokensvc.knowledge.formats.media_types import XLSX
from tokensvc.knowledge.formats.records import RecordTable, RowBudget
from tokensvc.knowledge.formats.refusals import over_limit, unreadable_as

__all__ = ["cell_text", "xlsx_document"]

_EXACT_INTEGERS = 2**53


def xlsx_document(content: bytes, limits: ExtractionLimits) -> ExtractedDocument:
    """The worksheets' records of the XLSX `content` (see the module docstring)."""
    check_archive(content, limits, "XLSX")
    builder, budget = TextBuilder(), RowBudget(limits)
    with unreadable_as("XLSX"):
        workbook = openpyxl.load_workbook(io.BytesIO(content), read_only=True, data_only=True)
        try:
            if len(workbook.sheetnames) > limits.max_sheets:
                raise over_limit(f"{len(workbook.sheetnames):,}", "sheets", limits.max_sheets)
            for sheet in workbook.worksheets:
                if not isinstance(sheet, ReadOnlyWorksheet):  # read-only mode gives no other kind
                    continue
                sheet.reset_dimensions()  # else iteration stops at the sheet's declared last row
                table = RecordTable(builder, sheet.title, heading=sheet.title)
                for number, values in enumerate(sheet.iter_rows(values_only=True), 1):
                    budget.take(len(values))
                    table.row(number, [cell_text(value) for value in values])
                table.finish()
        finally:
            workbook.close()
    return builder.document(XLSX)


def cell_text(value: object) -> str:
    """A cell's value as the module docstring says."""
    if value is None:
        text = ""
    elif isinstance(value, bool):
        text = "TRUE" if value else "FALSE"
    elif isinstance(value, float) and value.is_integer() and abs(value) < _EXACT_INTEGERS:
        text = str(int(value))
    elif isinstance(value, datetime.datetime) and value.time() == datetime.time():
        text = value.date().isoformat()
    elif isinstance(value, datetime.datetime):
        text = value.isoformat(sep=" ")
    elif isinstance(value, datetime.date | datetime.time):
        text = value.isoformat()
    else:
        text = str(value)
    return text
