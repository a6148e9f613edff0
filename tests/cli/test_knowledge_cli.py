"""`tokensvc kb ...` against a live service, as the README's quickstart runs it: a PDF, a DOCX, a
PPTX, an XLSX and a CSV (third-party documents, tests/knowledge/fixtures/documents/MANIFEST.tsv)
uploaded with `--wait`, listed with their states, and searched with page, slide and row locators;
an upload without `--wait` returns at once, and a refused one exits 1 saying why."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from tests.cli.test_capability_cli import connection, mint, tokensvc
from tokensvc.app import Service
from tokensvc.auth.devpki import DevPaths

DOCUMENTS = Path(__file__).resolve().parent.parent / "knowledge" / "fixtures" / "documents"


def languages_csv(path: Path) -> Path:
    """A CSV of the first ISO 639-3 languages (from the iso-codes fixture's JSON Lines)."""
    rows = ["code,scope,type,name"]
    for line in (DOCUMENTS / "iso-639-3-first-300.jsonl").read_text(encoding="utf-8").splitlines()[:120]:
        entry = json.loads(line)
        name = entry["name"].replace('"', "'")
        rows.append(f'{entry["alpha_3"]},{entry.get("scope", "")},{entry.get("type", "")},"{name}"')
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


async def test_the_quickstart_uploads_every_office_format_and_cites_pages_slides_and_rows(
    service: Service, dev: DevPaths, tmp_path: Path
) -> None:
    conn = connection(service, dev)
    kb = f"kb-{uuid.uuid4().hex[:8]}"
    code, _, err = await tokensvc("kb", "create", kb, "--chunking", "markdown", *conn)
    assert code == 0, err
    files = [
        DOCUMENTS / "r-intro.pdf",
        DOCUMENTS / "git-manual.docx",
        DOCUMENTS / "git-manual-slides.pptx",
        DOCUMENTS / "iso-codes.xlsx",
        languages_csv(tmp_path / "languages.csv"),
    ]
    for path in files:
        code, out, err = await tokensvc("kb", "upload", kb, str(path), "--wait", *conn)
        assert code == 0, err
        assert f"{path.name}: version 1, ready, " in out, out

    code, out, err = await tokensvc("kb", "documents", kb, *conn)
    assert code == 0, err
    listed = sorted(line.split()[0] for line in out.splitlines())
    assert listed == sorted(path.name for path in files)
    assert all("  v1  ready, " in line for line in out.splitlines()), out

    token = await mint(dev, "--namespace", "default", "--agent", "dev-agent", "--kb", kb)
    where = {}
    for query, document in (
        ("arithmetic vectors assignment", "r-intro.pdf"),
        ("stupid content tracker", "git-manual-slides.pptx"),
        ("Afghanistan", "iso-codes.xlsx"),
    ):
        code, out, err = await tokensvc(
            "kb", "search", query, "--kb", kb, "--mode", "text", "--top-k", "20", "--json", *conn,
            env={"TOKENSVC_CAPABILITY": token},
        )  # fmt: skip
        assert code == 0, err
        passages = [p for p in json.loads(out)["passages"] if p["document_ref"] == document]
        assert passages, (query, out[:2000])
        where[document] = passages[0]["location"]
    assert where["r-intro.pdf"]["first_page"] >= 1
    assert where["git-manual-slides.pptx"]["first_slide"] >= 1
    assert where["iso-codes.xlsx"]["sheet"] == "Countries"
    assert where["iso-codes.xlsx"]["first_row"] >= 1
    # The text output says where, as the README shows.
    code, out, err = await tokensvc(
        "kb", "search", "Afghanistan", "--kb", kb, "--mode", "text", *conn, env={"TOKENSVC_CAPABILITY": token}
    )
    assert code == 0, err
    assert " Countries rows " in out, out


async def test_an_upload_returns_at_once_and_a_refused_one_exits_1_saying_why(
    service: Service, dev: DevPaths, tmp_path: Path
) -> None:
    conn = connection(service, dev)
    kb = f"kb-{uuid.uuid4().hex[:8]}"
    code, _, err = await tokensvc("kb", "create", kb, "--chunking", "markdown", *conn)
    assert code == 0, err
    notes = tmp_path / "notes.md"
    notes.write_text("# Notes\n\nThe backups run at night.\n", encoding="utf-8")
    code, out, err = await tokensvc("kb", "upload", kb, str(notes), *conn)
    assert code == 0, err
    assert out.startswith("notes.md: version 1, "), out  # pending, or already further along

    broken = tmp_path / "broken.pdf"
    broken.write_bytes(b"%PDF-1.7\nnot a real PDF")
    code, out, err = await tokensvc("kb", "upload", kb, str(broken), "--wait", *conn)
    assert code == 1, (out, err)
    assert "broken.pdf: version 1, failed: " in out, out
    code, out, err = await tokensvc("kb", "documents", kb, *conn)
    assert code == 0, err
    assert "broken.pdf  v1  failed: " in out, out
