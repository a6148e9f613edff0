"""Where a passage is in its original: the source spans it overlaps give its pages, slides or rows;
and that location survives PostgreSQL's jsonb form."""

from __future__ import annotations

import json

from tokensvc.knowledge.formats import Location, SourceSpan, SpanIndex
from tokensvc.storage.postgres.locations import location_from, location_json, spans_from, spans_json
from tokensvc.storage.records import NOWHERE

# "one\n\ntwo\n\nthree": pages 1-3 at 0-3, 5-8, 10-15.
PAGES = (SourceSpan(0, 3, page=1), SourceSpan(5, 8, page=2), SourceSpan(10, 15, page=3))
ROWS = (
    SourceSpan(0, 10, sheet="Q1", row=2),
    SourceSpan(11, 20, sheet="Q1", row=3),
    SourceSpan(30, 40, sheet="Q2", row=2),
)


def test_a_passage_within_a_page_names_that_page() -> None:
    assert SpanIndex(PAGES).locate(5, 8) == Location(first_page=2, last_page=2)
    assert SpanIndex(PAGES).locate(11, 13) == Location(first_page=3, last_page=3)


def test_a_passage_across_pages_names_the_first_and_the_last() -> None:
    assert SpanIndex(PAGES).locate(1, 12) == Location(first_page=1, last_page=3)
    # The blank line between two pages belongs to neither: a passage ending there is on one page.
    assert SpanIndex(PAGES).locate(0, 4) == Location(first_page=1, last_page=1)


def test_rows_are_those_of_the_first_sheet_the_passage_touches() -> None:
    assert SpanIndex(ROWS).locate(0, 20) == Location(sheet="Q1", first_row=2, last_row=3)
    assert SpanIndex(ROWS).locate(15, 35) == Location(sheet="Q1", first_row=3, last_row=3)


def test_text_outside_every_span_or_a_format_without_spans_is_nowhere() -> None:
    assert SpanIndex(PAGES).locate(3, 5) == NOWHERE
    assert SpanIndex(()).locate(0, 10) == NOWHERE
    assert SpanIndex(PAGES).locate(7, 7) == NOWHERE


def test_locations_and_spans_survive_their_stored_form() -> None:
    for location in (
        Location(first_page=3, last_page=4),
        Location(first_slide=2, last_slide=2),
        Location(sheet="Q1", first_row=10, last_row=42),
        Location(first_row=7, last_row=7),
    ):
        encoded = location_json(location)
        assert encoded is not None
        assert location_from(json.loads(encoded)) == location
    assert location_json(NOWHERE) is None
    assert location_from(None) == NOWHERE
    assert spans_from(spans_json(PAGES + ROWS)) == PAGES + ROWS
    assert spans_json(()) is None
    assert spans_from(None) == ()
