"""Passage locations and a document's source spans as PostgreSQL stores them (jsonb).

A chunk's `location`: `{"pages": [first, last]}`, `{"slides": [first, last]}`,
`{"sheet": name, "rows": [first, last]}` (each key only where the format has it), NULL where it
has none. A document's `source_spans`: `[[start, end, page, slide, sheet, row], ...]`, NULL when
it has none (migration 0023).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tokensvc.storage.records import NOWHERE, Location, SourceSpan

__all__ = ["location_from", "location_json", "spans_from", "spans_json"]


def location_json(location: Location) -> str | None:
    """A chunk's location as the JSON text a chunk INSERT takes (None: nowhere)."""
    if location.empty:
        return None
    value: dict[str, Any] = {}
    if location.first_page:
        value["pages"] = [location.first_page, location.last_page]
    if location.first_slide:
        value["slides"] = [location.first_slide, location.last_slide]
    if location.sheet:
        value["sheet"] = location.sheet
    if location.first_row:
        value["rows"] = [location.first_row, location.last_row]
    return json.dumps(value, separators=(",", ":"))


def location_from(value: dict[str, Any] | None) -> Location:
    """A stored location (jsonb, decoded) as a record."""
    if not value:
        return NOWHERE
    pages = value.get("pages") or (0, 0)
    slides = value.get("slides") or (0, 0)
    rows = value.get("rows") or (0, 0)
    return Location(
        first_page=int(pages[0]),
        last_page=int(pages[1]),
        first_slide=int(slides[0]),
        last_slide=int(slides[1]),
        sheet=str(value.get("sheet", "")),
        first_row=int(rows[0]),
        last_row=int(rows[1]),
    )


def spans_json(spans: Sequence[SourceSpan]) -> list[list[Any]] | None:
    """A document's source spans as its jsonb column holds them (None: it has none)."""
    if not spans:
        return None
    return [[s.start, s.end, s.page, s.slide, s.sheet, s.row] for s in spans]


def spans_from(value: list[list[Any]] | None) -> tuple[SourceSpan, ...]:
    """Stored source spans (jsonb, decoded) as records."""
    return tuple(
        SourceSpan(int(start), int(end), int(page), int(slide), str(sheet), int(row))
        for start, end, page, slide, sheet, row in value or ()
    )
