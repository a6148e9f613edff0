"""`application/json`, and JSON Lines (`application/jsonl`, `application/x-ndjson`).

- JSON: the UTF-8 document (a leading byte-order mark dropped) is parsed and its value rendered
  as indented JSON: Python's `json.dumps(value, indent=2, ensure_ascii=False)` (keys in their
  order, non-ASCII as itself, numbers as Python writes them). No source spans.
- JSON Lines: each non-empty line (`\\n` ends one, a `\\r` before it is dropped) is one JSON
  value, rendered compact on one line (`json.dumps(value, ensure_ascii=False)`: `, ` and `: `
  between items); the lines are joined by `\\n`, each a `SourceSpan(row=n)` with its line number
  in the file (1-based, blank lines counted).

Refused (`InvalidArgument` on `content`): not UTF-8; not JSON ("is not valid JSON: ..." with
the parser's line and column; for JSON Lines "line N is not valid JSON: ..."); `NaN` or
`Infinity` (not JSON, though Python reads them); a string holding an unpaired surrogate
(`\\ud800`: it cannot be stored as text; control characters such as U+0000 stay escapes); arrays and objects nested deeper than
`ExtractionLimits.max_nesting` ("is nested deeper than N levels", checked without recursion).
`PayloadTooLarge` for JSON Lines with more lines than `max_rows`.
"""

from __future__ import annotations

import json
import re

from tokensvc.errors import InvalidArgument
from tokensvc.knowledge.formats.builder import TextBuilder
from tokensvc.knowledge.formats.documents import ExtractedDocument, ExtractionLimits
from tokensvc.knowledge.formats.records import RowBudget
from tokensvc.knowledge.formats.text import decoded_text

__all__ = ["json_document", "json_lines_document", "ndjson_document"]

_UNSTORABLE = re.compile("[\ud800-\udfff]")


def json_document(content: bytes, limits: ExtractionLimits) -> ExtractedDocument:
    """The JSON `content` as indented JSON (see the module docstring)."""
    value = _parsed(decoded_text(content), limits, "")
    return ExtractedDocument(_storable(json.dumps(value, indent=2, ensure_ascii=False)), "application/json")


def ndjson_document(content: bytes, limits: ExtractionLimits) -> ExtractedDocument:
    """`json_lines_document`, declared as `application/x-ndjson`."""
    return json_lines_document(content, limits, "application/x-ndjson")


def json_lines_document(
    content: bytes, limits: ExtractionLimits, media_type: str = "application/jsonl"
) -> ExtractedDocument:
    """The JSON Lines `content`, a record a line (see the module docstring)."""
    builder, budget = TextBuilder(), RowBudget(limits)
    for number, line in enumerate(decoded_text(content).split("\n"), 1):
        if line.strip():
            budget.take(0)
            value = _parsed(line, limits, f"line {number} ")
            builder.add(_storable(json.dumps(value, ensure_ascii=False)), "\n", row=number)
    return builder.document(media_type)


def _parsed(text: str, limits: ExtractionLimits, where: str) -> object:
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except RecursionError:  # far deeper than any limit: the parser recurses per level
        raise _too_deep(limits, where) from None
    except ValueError as error:  # JSONDecodeError, NaN, or an integer of over 4,300 digits
        raise InvalidArgument("content", f"{where}is not valid JSON: {error}") from None
    if _deeper_than(value, limits.max_nesting):
        raise _too_deep(limits, where)
    return value


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _too_deep(limits: ExtractionLimits, where: str) -> InvalidArgument:
    return InvalidArgument("content", f"{where}is nested deeper than {limits.max_nesting} levels")


def _deeper_than(value: object, limit: int) -> bool:
    """Whether `value` holds arrays or objects more than `limit` deep (walked without recursion)."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


def _storable(text: str) -> str:
    found = _UNSTORABLE.search(text)
    if found:
        code = f"U+{ord(found.group()):04X}"
        raise InvalidArgument("content", f"holds a string with {code}, which cannot be stored as text")
    return text
