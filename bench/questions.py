"""The knowledge-base question set (`bench/kb_questions.toml`) and where each answer is.

Each question quotes its answer from a document verbatim; `locate_all` finds every answer exactly
once in its document's extracted text. Questions over paged or tabular documents may also say where
the answer is in the original (`page`, `slide`, `sheet`, `row`: bench/document_quality.py's
question file); `load_extracted` extracts such documents by their file type. Kept apart from `bench.knowledge_quality` (which needs the
`bench` extra to run) so the test suite can check the quotes on a plain install.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokensvc.knowledge.formats import (
    ExtractedDocument,
    extract_document,
    extract_text,
    media_type_for_filename,
)

__all__ = [
    "CONTENT_TYPE",
    "QUESTIONS",
    "Question",
    "Span",
    "covers",
    "load_documents",
    "load_extracted",
    "load_questions",
    "locate",
    "locate_all",
]

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = ROOT / "bench" / "kb_questions.toml"
CONTENT_TYPE = "text/markdown"


@dataclass(frozen=True)
class Question:
    """One hand-written question; `answer` is an exact passage of `doc` (whitespace collapsed)."""

    number: int  # 1-based, in file order
    doc: str
    question: str
    answer: str
    style: str  # "paraphrase" or "keyword"
    # Where the answer is in the original, 1-based, 0 or empty where not given: a PDF's page, a
    # PPTX's slide, a spreadsheet's sheet and a row as the file numbers it (XLSX, CSV, JSON Lines).
    page: int = 0
    slide: int = 0
    sheet: str = ""
    row: int = 0


@dataclass(frozen=True)
class Span:
    """Where an answer is in its document's extracted text (code points, end exclusive)."""

    start: int
    end: int


def load_questions(path: Path = QUESTIONS) -> list[Question]:
    """The `[[question]]` tables of `path`, checked for the required fields."""
    tables = tomllib.loads(path.read_text(encoding="utf-8")).get("question", [])
    questions = []
    for number, table in enumerate(tables, start=1):
        missing = {"doc", "question", "answer"} - table.keys()
        if missing:
            raise ValueError(f"{path.name}: question {number} lacks {', '.join(sorted(missing))}")
        answer = " ".join(str(table["answer"]).split())
        style = str(table.get("style", "paraphrase"))
        where = {key: table[key] for key in ("page", "slide", "sheet", "row") if key in table}
        questions.append(Question(number, str(table["doc"]), str(table["question"]), answer, style, **where))
    return questions


def load_documents(names: Sequence[str]) -> dict[str, str]:
    """Each document's extracted text, read once: the answers are located, the chunks resolved and
    the uploads made from this snapshot, so a document edited during a run cannot skew it."""
    return {name: extract_text((ROOT / name).read_bytes(), CONTENT_TYPE) for name in names}


def load_extracted(names: Sequence[str]) -> dict[str, ExtractedDocument]:
    """Each document's text and source spans, extracted as its file type (`media_type_for_filename`)
    says, read once like `load_documents`."""
    documents = {}
    for name in names:
        media_type = media_type_for_filename(name)
        if media_type is None:
            raise ValueError(f"{name}: no media type for this file name")
        documents[name] = extract_document((ROOT / name).read_bytes(), media_type)
    return documents


def locate(text: str, answer: str) -> Span:
    """The one occurrence of `answer` in `text`, any run of whitespace matching any other."""
    pattern = r"\s+".join(re.escape(word) for word in answer.split())
    found = [match.span() for match in re.finditer(pattern, text)]
    if len(found) != 1:
        raise ValueError(f"answer occurs {len(found)} times, expected exactly once: {answer!r}")
    return Span(*found[0])


def locate_all(questions: Sequence[Question], documents: dict[str, str]) -> dict[int, Span]:
    """Every question's answer span, by question number; all problems reported at once."""
    spans, problems = {}, []
    for q in questions:
        try:
            spans[q.number] = locate(documents[q.doc], q.answer)
        except ValueError as error:
            problems.append(f"question {q.number} ({q.doc}): {error}")
    if problems:
        raise ValueError("bad answers in the questions file:\n  " + "\n  ".join(problems))
    return spans


def covers(location: Any, q: Question) -> bool | None:
    """Whether a location (of a passage from the question's document) covers the question's
    truth; None when the question has none."""
    if q.page:
        return bool(location.first_page <= q.page <= location.last_page)
    if q.slide:
        return bool(location.first_slide <= q.slide <= location.last_slide)
    if q.row:
        return bool(location.sheet == q.sheet and location.first_row <= q.row <= location.last_row)
    return None
