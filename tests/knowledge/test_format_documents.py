"""PDF, DOCX and PPTX: real third-party files (fixtures/documents/MANIFEST.tsv) and small files made
with python-docx / python-pptx, extracted as the workers do: pages, headings, slides and notes
land where a citation needs them."""

from __future__ import annotations

import re

import pytest
from docx.document import Document
from pptx.presentation import Presentation
from pptx.util import Inches

from tests.knowledge.document_support import DOCX, PPTX, document, made_docx, made_pptx
from tokensvc.errors import PayloadTooLarge
from tokensvc.knowledge import ChunkingKind, ChunkingStrategy, chunk_document
from tokensvc.knowledge.formats import ExtractionLimits, SpanIndex, extract_document

MARKDOWN = ChunkingStrategy(ChunkingKind.MARKDOWN, 128, 16)
RECURSIVE = ChunkingStrategy(ChunkingKind.RECURSIVE, 128, 16)
R_INTRO = document("r-intro.pdf")

# --- PDF -----------------------------------------------------------------------------------------


def test_each_pdf_page_is_a_span_holding_that_pages_text() -> None:
    extracted = extract_document(R_INTRO, "application/pdf")
    assert extracted.media_type == "application/pdf"
    assert [span.page for span in extracted.spans] == list(range(1, 114))
    page7 = extracted.spans[6]
    sentence = "This introduction to R is derived from an original set of notes"
    assert page7.start <= extracted.text.index(sentence) < page7.end
    assert "An Introduction to R" in extracted.text[: extracted.spans[0].end]


def test_pdf_pages_are_joined_by_a_blank_line_and_normalised() -> None:
    extracted = extract_document(R_INTRO, "application/pdf")
    text = extracted.text
    between = {text[a.end : b.start] for a, b in zip(extracted.spans, extracted.spans[1:], strict=False)}
    assert between == {"\n\n"}
    assert not re.search(r"[\r\ufffe\x00-\x08\x0b-\x1f]|[ \t]\n", text)
    page9 = extracted.spans[8]
    # PDFium marked "pack-ages" as hyphenated at a line end: the word is whole again.
    assert "packages" in text[page9.start : page9.end]


def test_a_passage_cited_from_a_pdf_names_its_page_or_both_pages() -> None:
    extracted = extract_document(R_INTRO, "application/pdf")
    index = SpanIndex(extracted.spans)
    chunks = chunk_document(extracted.text, RECURSIVE)
    sentence = extracted.text.index("We would like to extend warm thanks to Bill Venables")
    (chunk,) = [c for c in chunks if c.start <= sentence < c.end]
    located = index.locate(chunk.start, chunk.end)
    assert located.first_page <= 7 <= located.last_page
    across = [
        (c, where) for c in chunks if (where := index.locate(c.start, c.end)).first_page < where.last_page
    ]
    assert across
    for chunk, where in across:  # a chunk across pages says both, and holds text of both
        assert chunk.start < extracted.spans[where.first_page - 1].end
        assert chunk.end > extracted.spans[where.last_page - 1].start


def test_a_pdf_whose_pages_partly_lack_text_keeps_the_pages_with_text() -> None:
    extracted = extract_document(document("live-manual-landscape-en.pdf"), "application/pdf")
    pages = [span.page for span in extracted.spans]
    assert 0 < len(pages) < 31
    assert pages == sorted(pages)
    assert pages[-1] <= 31
    for span in extracted.spans:
        assert extracted.text[span.start : span.end].strip()


def test_a_pdf_with_more_pages_than_the_limit_is_too_large() -> None:
    with pytest.raises(PayloadTooLarge) as refused:
        extract_document(R_INTRO, "application/pdf", ExtractionLimits(max_pages=100))
    assert refused.value.field == "content"
    assert "113 pages, more than the limit of 100" in refused.value.message


# --- DOCX ----------------------------------------------------------------------------------------


def test_docx_headings_become_the_heading_paths_of_passages() -> None:
    extracted = extract_document(document("git-manual.docx"), DOCX)
    assert (extracted.media_type, extracted.spans) == (DOCX, ())
    assert extracted.text.startswith("# git(1) manual page\n\n## Name\n\ngit - the stupid content tracker")
    chunks = chunk_document(extracted.text, MARKDOWN)
    (chunk,) = [c for c in chunks if "Prints the Git suite version" in c.text]
    assert chunk.heading_path == ("git(1) manual page", "Options", "-v, --version")


def test_docx_tables_are_rows_of_cells_in_their_place() -> None:
    text = extract_document(document("git-manual.docx"), DOCX).text
    header = text.index("\nOption | Meaning\n")
    assert text.rindex("## Environment Variables", 0, header) > 0
    assert re.search(r"\nGIT_DIR \| If the GIT_DIR environment variable is set", text)


def test_docx_headings_by_direct_formatting_only_are_plain_paragraphs() -> None:
    text = extract_document(document("tar-manual-fake-headings.docx"), DOCX).text
    assert re.findall(r"(?m)^#+ .*", text) == ["# tar(1) manual page"]  # its Title, styled
    assert "\n\nSynopsis\n\n" in text or "\n\nSYNOPSIS\n\n" in text


def _docx_with_traps(made: Document) -> None:
    made.add_heading("Deploying", level=1)
    made.add_paragraph("# not a heading, a shell comment\nsecond line")
    made.add_paragraph("```")
    made.add_heading("Rollback", level=2)
    table = made.add_table(rows=2, cols=3)
    table.cell(0, 0).merge(table.cell(0, 1)).text = "Merged"
    table.cell(0, 2).text = "Right"
    table.cell(1, 0).text = "a\nb"
    made.add_paragraph("   ")


def test_docx_body_lines_markdown_would_misread_are_escaped() -> None:
    text = extract_document(made_docx(_docx_with_traps), DOCX).text
    assert text == (
        "# Deploying\n\n\\# not a heading, a shell comment\nsecond line\n\n\\```\n\n## Rollback\n\n"
        "Merged | Right\na b |  | "
    )
    paths = {c.heading_path for c in chunk_document(text, MARKDOWN)}
    assert paths == {("Deploying",), ("Deploying", "Rollback")}


# --- PPTX ----------------------------------------------------------------------------------------


def test_each_slide_is_a_titled_section_with_its_notes() -> None:
    extracted = extract_document(document("git-manual-slides.pptx"), PPTX)
    assert [span.slide for span in extracted.spans] == list(range(1, 26))
    sections = [extracted.text[span.start : span.end] for span in extracted.spans]
    assert all(section.startswith("# ") for section in sections)
    assert sum("\n\nNotes: " in section for section in sections) == 24
    name = sections[1]
    assert name.startswith("# Name\n\ngit - the stupid content tracker")
    assert name.endswith("Notes: git - the stupid content tracker")
    table = next(section for section in sections if "Option | Meaning" in section)
    assert table.startswith("# Environment Variables")


def test_passages_of_a_deck_are_cited_to_their_slide_under_its_title() -> None:
    extracted = extract_document(document("git-manual-slides.pptx"), PPTX)
    index = SpanIndex(extracted.spans)
    for chunk in chunk_document(extracted.text, MARKDOWN):
        where = index.locate(chunk.start, chunk.end)
        assert where.first_slide == where.last_slide > 0  # a heading opens every slide
        section = extracted.text[extracted.spans[where.first_slide - 1].start :]
        assert section.startswith("# " + chunk.heading_path[0])


def _deck(made: Presentation) -> None:
    titled = made.slides.add_slide(made.slide_layouts[5])
    titled.shapes.title.text = "Tides\vand moons"
    untitled = made.slides.add_slide(made.slide_layouts[6])
    group = untitled.shapes.add_group_shape()
    box = group.shapes.add_textbox(Inches(1), Inches(1), Inches(3), Inches(1))
    box.text_frame.text = "inside a group\n# hash line"
    untitled.notes_slide.notes_text_frame.text = "say this"


def test_a_slide_without_a_title_is_named_by_its_number_and_groups_are_read() -> None:
    extracted = extract_document(made_pptx(_deck), PPTX)
    assert (
        extracted.text == "# Tides and moons\n\n# Slide 2\n\ninside a group\n\\# hash line\n\nNotes: say this"
    )
    assert [(s.slide, extracted.text[s.start : s.end][:9]) for s in extracted.spans] == [
        (1, "# Tides a"),
        (2, "# Slide 2"),
    ]


def test_a_deck_with_more_slides_than_the_limit_is_too_large() -> None:
    with pytest.raises(PayloadTooLarge) as refused:
        extract_document(document("git-manual-slides.pptx"), PPTX, ExtractionLimits(max_slides=20))
    assert refused.value.field == "content"
    assert "25 slides, more than the limit of 20" in refused.value.message
