"""The README stays true to the code: every setting, command, proto and package is documented."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from tokensvc.cli.main import build_parser
from tokensvc.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_every_setting_is_in_the_readme() -> None:
    missing = [f.name for f in dataclasses.fields(Settings) if f"`{f.name}`" not in README]
    assert not missing, f"document these settings in README.md: {missing}"


def test_every_top_level_command_is_in_the_readme() -> None:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(getattr(a, "choices", None), dict)).choices
    missing = [name for name in commands if f"tokensvc {name}" not in README]
    assert not missing, f"document these commands in README.md: {missing}"


def test_the_readme_layout_names_every_proto_file() -> None:
    line = next(line for line in README.splitlines() if line.startswith("protos/tokensvc/v1/"))
    listed = {name.strip() for name in line.split(":", 1)[1].split(",")}
    shipped = {path.stem for path in (ROOT / "protos" / "tokensvc" / "v1").glob("*.proto")}
    assert listed == shipped, f"README layout lists {sorted(listed)}, protos/ has {sorted(shipped)}"


def test_the_readme_layout_and_docs_name_every_client() -> None:
    lines = README.splitlines()
    clients = sorted(path.name for path in (ROOT / "clients").iterdir() if path.is_dir())
    unlisted = [name for name in clients if not any(line.startswith(f"clients/{name}/ ") for line in lines)]
    assert not unlisted, f"add these clients to the README's layout map: {unlisted}"
    unlinked = [name for name in clients if f"(clients/{name}/README.md)" not in README]
    assert not unlinked, f"link these clients' READMEs from the README's docs list: {unlinked}"


def test_the_readme_layout_names_every_package() -> None:
    lines = README.splitlines()
    packages = sorted(path.parent.name for path in (ROOT / "tokensvc").glob("*/__init__.py"))
    missing = [name for name in packages if not any(line.startswith(f"  {name}/ ") for line in lines)]
    assert not missing, f"add these packages to the README's layout map: {missing}"


def test_the_readme_layout_names_every_document_format_module() -> None:
    lines = README.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("    formats/ "))
    block = " ".join(lines[start : start + 3])
    modules = sorted(p.stem for p in (ROOT / "tokensvc" / "knowledge" / "formats").glob("[!_]*.py"))
    missing = [name for name in modules if not re.search(rf"\b{name}\b", block)]
    assert not missing, f"add these modules to the README's formats line: {missing}"


def test_every_knowledge_base_question_quotes_its_document_exactly_once() -> None:
    # bench/kb_questions.toml quotes the docs: an edit that drops or repeats an answer would only
    # show when the quality benchmark runs; here it fails with the list of questions to fix.
    from bench.questions import load_documents, load_questions, locate_all

    questions = load_questions()
    spans = locate_all(questions, load_documents(sorted({q.doc for q in questions})))
    assert len(spans) == len(questions) > 50


def test_every_document_question_quotes_its_document_once_where_its_location_says() -> None:
    # bench/document_questions.toml quotes third-party PDF/DOCX/PPTX/XLSX/CSV/JSONL files as the
    # service extracts them, with the page, slide or row found by other tools: an extraction change
    # that moves, drops or repeats an answer, or a locator that disagrees, fails here.
    from bench.questions import covers, load_extracted, load_questions, locate_all
    from tokensvc.knowledge.formats import SpanIndex

    questions = load_questions(ROOT / "bench" / "document_questions.toml")
    documents = load_extracted(sorted({q.doc for q in questions}))
    answers = locate_all(questions, {name: document.text for name, document in documents.items()})
    assert len(answers) == len(questions) >= 100
    assert sum(bool(q.page or q.slide or q.row) for q in questions) > 90  # the locations are checked
    misplaced = []
    for q in questions:
        start = answers[q.number].start
        location = SpanIndex(documents[q.doc].spans).locate(start, start + 1)
        if covers(location, q) is False:
            misplaced.append((q.number, q.doc, q.page or q.slide or (q.sheet, q.row), location))
    assert not misplaced


def test_the_go_clients_readme_example_is_the_example_go_test_compiles() -> None:
    readme = (ROOT / "clients/go/README.md").read_text()
    (block,) = re.findall(r"^## A launcher's Remember and Search\n\n```go\n(.*?)^```$", readme, re.M | re.S)
    example = (ROOT / "clients/go/example_test.go").read_text()
    (body,) = re.findall(r"^func Example\(\) \{\n(.*?)^\}$", example, re.M | re.S)
    unindented = "".join(line.removeprefix("\t") for line in body.splitlines(keepends=True))
    assert block == unindented, "clients/go/README.md's example differs from example_test.go's Example"
    assert len(block.splitlines()) < 30, (
        "the issue asked for a launcher's Remember + Search in under 30 lines"
    )
