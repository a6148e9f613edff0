"""KnowledgeService end to end: real mTLS, real PostgreSQL + pgvector, the dev PKI.

Corpora are managed over the control-plane certificate and searched over the dev launcher's with a
capability whose `kbs` claim grants them; the database is checked directly as the superuser.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from tests.api.knowledge_support import (
    FIXED,
    HANDBOOK,
    HYBRID,
    MARKDOWN,
    NAMESPACE,
    RECURSIVE,
    VECTOR,
    Clients,
    Searcher,
    assert_cited,
    chunk_rows,
    eq,
    failure,
    heading_path_at,
    new_ref,
    open_clients,
    row_counts,
    upload_stream,
)
from tests.conftest import ServiceFactory
from tests.support import SharedDatabase, superuser
from tokensvc.app import Service
from tokensvc.auth.devpki import CONTROL_PLANE_SPIFFE_ID, DevPaths
from tokensvc.knowledge.formats import extract_text
from tokensvc.v1 import knowledge_pb2

HANDBOOK_TEXT = HANDBOOK.read_text(encoding="utf-8")
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture
async def clients(service: Service, dev: DevPaths) -> AsyncIterator[Clients]:
    async with open_clients(service, dev) as opened:
        yield opened


# --- search with citations -----------------------------------------------------------------------

# A query, and the section (innermost heading) the best passage must come from.
SECTION_QUERIES = [
    ("canary analysis error rate latency baseline", "Canary Analysis"),
    ("severity levels incident commander", "Severity Levels"),
    ("rollback previous release", "Rollbacks"),
    ("schema migrations advisory lock replicas", "Schema Migrations"),
    ("secrets mounted password environment", "Secrets"),
]


async def test_handbook_passages_cite_exact_offsets_and_heading_paths(clients: Clients) -> None:
    kb, manager = new_ref(), clients.manager()
    await manager.create(kb, MARKDOWN)
    uploaded = await manager.upload(kb, "handbook.md", HANDBOOK_TEXT.encode(), content_type="text/markdown")
    assert (uploaded.document.version, uploaded.unchanged) == (1, False)
    assert uploaded.chunk_count == uploaded.document.chunk_count > 10
    assert uploaded.document.size_bytes == len(HANDBOOK_TEXT.encode())
    searcher = clients.searcher([kb])
    seen: set[int] = set()
    for query, section in SECTION_QUERIES:
        passages = await searcher.search(query, [kb], top_k=5)
        assert 0 < len(passages) <= 5
        assert passages[0].heading_path[-1] == section, (query, list(passages[0].heading_path))
        assert [p.score for p in passages] == sorted((p.score for p in passages), reverse=True)
        for passage in passages:
            assert_cited(passage, HANDBOOK_TEXT)
            assert (passage.knowledge_base_ref, passage.document_ref) == (kb, "handbook.md")
            assert passage.document_version == 1
            # The section the passage lies in: chunks never cross a section boundary.
            assert tuple(passage.heading_path) == heading_path_at(HANDBOOK_TEXT, passage.end_offset - 1)
            assert passage.heading_path[0] == "Platform Engineering Handbook"
            assert passage.vector_rank > 0 or passage.text_rank > 0
            seen.add(passage.chunk_index)
        # Hybrid: a fused score between 0 and 1; the best passage has one of the rankers' best.
        assert all(0.0 <= p.score <= 1.0 for p in passages)
        assert any(p.text_rank > 0 for p in await searcher.search(section, [kb], top_k=3))
    assert len(seen) >= len(SECTION_QUERIES)

    vector = await searcher.search("canary analysis error rate", [kb], top_k=7, mode=VECTOR)
    assert len(vector) == 7
    assert vector[0].heading_path[-1] == "Canary Analysis"
    assert [p.score for p in vector] == sorted((p.score for p in vector), reverse=True)
    for passage in vector:
        assert_cited(passage, HANDBOOK_TEXT)
        assert -1.0 <= passage.score <= 1.0
        assert (passage.vector_rank, passage.text_rank) == (0, 0)  # the proto: always 0 in VECTOR mode

    every_chunk = await searcher.search("deploys", [kb], top_k=100, mode=VECTOR)
    assert len(every_chunk) == uploaded.chunk_count  # top_k above the corpus size returns all of it
    assert sorted(p.chunk_index for p in every_chunk) == list(range(uploaded.chunk_count))
    assert len(await searcher.search("deploys", [kb], top_k=1)) == 1
    assert len(await searcher.search("deploys", [kb])) == 10  # 0 means 10


async def test_metadata_filter_restricts_search_and_listing(clients: Clients) -> None:
    kb, manager = new_ref(), clients.manager()
    await manager.create(kb, RECURSIVE)
    for team, tier, text in (("ops", 1, "Pager rotation and escalation."), ("dev", 2, "Pager etiquette.")):
        await manager.upload(
            kb, f"{team}.txt", text, content_type="text/plain", metadata={"team": team, "tier": tier}
        )
    searcher = clients.searcher([kb])
    assert {p.document_ref for p in await searcher.search("pager", [kb])} == {"ops.txt", "dev.txt"}
    for team in ("ops", "dev"):
        for mode in (VECTOR, HYBRID):
            found = await searcher.search("pager", [kb], mode=mode, filter_=eq("team", team))
            assert [p.document_ref for p in found] == [f"{team}.txt"]
    assert await searcher.search("pager", [kb], filter_=eq("team", "nobody")) == []
    listed = await manager.list_documents(kb, 10, eq("tier", 2))
    assert [[d.ref for d in page] for page in listed] == [["dev.txt"]]
    assert listed[0][0].metadata["team"].string_value == "dev"


# --- chunking ------------------------------------------------------------------------------------


def word_index(text: str) -> dict[int, int]:
    """Word start offset -> word number (the handbook has no word over 64 code points)."""
    return {match.start(): n for n, match in enumerate(re.finditer(r"\S+", text))}


@pytest.mark.parametrize(
    ("kind", "size", "overlap"), [(FIXED, 40, 10), (RECURSIVE, 50, 12), (MARKDOWN, 64, 16)]
)
async def test_chunking_strategies_slice_exactly_with_custom_size_and_overlap(
    clients: Clients, database: SharedDatabase, kind: int, size: int, overlap: int
) -> None:
    kb, manager = new_ref(), clients.manager()
    created = await manager.create(kb, kind, size, overlap)
    assert created.created
    pinned = (await manager.get(kb)).chunking
    assert (pinned.kind, pinned.chunk_size, pinned.chunk_overlap) == (kind, size, overlap)
    uploaded = await manager.upload(kb, "handbook.md", HANDBOOK_TEXT.encode())

    rows = await chunk_rows(database, kb, "handbook.md")
    assert [row["chunk_index"] for row in rows] == list(range(uploaded.chunk_count))
    words = word_index(HANDBOOK_TEXT)
    spans = []
    for row in rows:
        assert HANDBOOK_TEXT[row["start_offset"] : row["end_offset"]] == row["text"]
        first = words[row["start_offset"]]
        count = len(row["text"].split())
        assert 0 < count <= size
        spans.append((first, first + count, tuple(row["heading_path"])))
    # Every word is in some chunk; consecutive chunks share at most `overlap` words.
    assert spans[0][0] == 0
    assert spans[-1][1] == len(words)
    for (_, end, path), (first, _, next_path) in itertools.pairwise(spans):
        shared = end - first
        if kind == FIXED:
            assert shared == overlap
        elif kind == MARKDOWN and path != next_path:
            assert shared <= 0
        else:
            assert 0 <= shared <= overlap
    if kind == MARKDOWN:
        for row, (_, _, path) in zip(rows, spans, strict=True):
            assert path == heading_path_at(HANDBOOK_TEXT, row["end_offset"] - 1)
    else:
        assert all(path == () for _, _, path in spans)

    passages = await clients.searcher([kb]).search("code review approval", [kb], top_k=100)
    assert len(passages) == min(100, uploaded.chunk_count)
    for passage in passages:
        assert_cited(passage, HANDBOOK_TEXT)


async def test_chunk_size_zero_means_256_and_overlap_zero(clients: Clients) -> None:
    kb, manager = new_ref(), clients.manager()
    base = (await manager.create(kb, FIXED)).knowledge_base
    for got in (base, await manager.get(kb)):
        assert got.chunking == knowledge_pb2.ChunkingStrategy(kind=FIXED, chunk_size=256, chunk_overlap=0)
        assert (got.namespace, got.ref, got.embedder, got.dimension) == (NAMESPACE, kb, "hash", 384)
    # Asking again with the default spelled out is the same configuration.
    again = await manager.create(kb, FIXED, 256, 0)
    assert not again.created


# --- pinned choices ------------------------------------------------------------------------------


@pytest.fixture
async def two_embedders(
    start_service: ServiceFactory, dev: DevPaths, tmp_path: Path
) -> AsyncIterator[Clients]:
    config = tmp_path / "embedders.toml"
    config.write_text('[embedders.hash128]\nkind = "hash"\ndimension = 128\n', encoding="utf-8")
    service = await start_service(embedders_file=config)
    async with open_clients(service, dev) as opened:
        yield opened


async def test_pinned_embedder_and_chunking_cannot_change(
    two_embedders: Clients, database: SharedDatabase
) -> None:
    kb, manager = new_ref(), two_embedders.manager()
    first = await manager.create(kb, MARKDOWN, 128, 8, embedder="hash", display_name="Handbook")
    assert first.created
    await manager.upload(kb, "a.md", "# Title\n\nSome body text.")
    same = await manager.create(kb, MARKDOWN, 128, 8, embedder="hash", display_name="Renamed")
    assert not same.created
    assert same.knowledge_base.display_name == "Handbook"  # nothing changes, not even the name
    assert (same.knowledge_base.embedder, same.knowledge_base.dimension) == ("hash", 384)
    assert same.knowledge_base.document_count == 1
    assert not (await manager.create(kb, MARKDOWN, 128, 8)).created  # "" is the default, `hash`

    pinned = {"kind": MARKDOWN, "size": 128, "overlap": 8, "embedder": "hash"}
    for change in ({"embedder": "hash128"}, {"kind": FIXED}, {"size": 256}, {"overlap": 0}):
        failed = await failure(manager.create(kb, **{**pinned, **change}))  # type: ignore[arg-type]
        assert (failed.code, failed.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "PINNED_CONFIGURATION")
    after = await manager.get(kb)
    assert after.chunking == knowledge_pb2.ChunkingStrategy(kind=MARKDOWN, chunk_size=128, chunk_overlap=8)
    assert (after.embedder, after.display_name) == ("hash", "Handbook")
    assert (await row_counts(database, kb))[:2] == (1, 1)

    # The second embedder works end to end, with its own dimension.
    other = new_ref()
    base = (await manager.create(other, RECURSIVE, embedder="hash128")).knowledge_base
    assert (base.embedder, base.dimension) == ("hash128", 128)
    await manager.upload(
        other, "b.txt", "Vectors of one hundred and twenty-eight dimensions.", content_type="text/plain"
    )
    found = await two_embedders.searcher([kb, other]).search("dimensions body", top_k=10)
    assert {p.knowledge_base_ref for p in found} == {kb, other}


@pytest.mark.parametrize(
    ("case", "options", "field"),
    [
        ("unknown embedder", {"embedder": "no-such-embedder"}, "embedder"),
        ("kind unspecified", {"kind": knowledge_pb2.CHUNKING_KIND_UNSPECIFIED}, "chunking.kind"),
        ("no chunking", {"chunking": False}, "chunking.kind"),
        ("overlap half the size", {"size": 32, "overlap": 16}, "chunking.chunk_overlap"),
        ("overlap negative", {"size": 32, "overlap": -1}, "chunking.chunk_overlap"),
        ("overlap with the default size", {"overlap": 128}, "chunking.chunk_overlap"),
        ("size too small", {"size": 15}, "chunking.chunk_size"),
        ("size too large", {"size": 2049}, "chunking.chunk_size"),
    ],
)
async def test_invalid_knowledge_base_is_refused_naming_the_field(
    clients: Clients, database: SharedDatabase, case: str, options: dict[str, object], field: str
) -> None:
    kb = new_ref()
    failed = await failure(clients.manager().create(kb, **{"kind": FIXED, **options}))  # type: ignore[arg-type]
    assert (failed.code, failed.reason, failed.field_violations) == (INVALID, "INVALID_ARGUMENT", [field])
    assert failed.metadata["field"] == field, case
    assert await row_counts(database, kb) == (0, 0, 0)


# --- documents -----------------------------------------------------------------------------------


async def test_reupload_is_a_no_op_and_new_content_swaps_versions(
    clients: Clients, database: SharedDatabase
) -> None:
    kb, manager = new_ref(), clients.manager()
    await manager.create(kb, RECURSIVE, 16)
    v1 = "First version. " + " ".join(f"old{i}" for i in range(60))
    first = await manager.upload(kb, "doc", v1, content_type="text/plain", metadata={"rev": "a"})
    before = await chunk_rows(database, kb, "doc")
    assert {row["version"] for row in before} == {1}
    assert len(before) == first.chunk_count > 1

    again = await manager.upload(kb, "doc", v1, content_type="text/plain", metadata={"rev": "a"})
    assert (again.unchanged, again.document.version, again.chunk_count) == (True, 1, first.chunk_count)
    assert again.document.content_sha256 == first.document.content_sha256
    assert await chunk_rows(database, kb, "doc") == before  # nothing re-chunked or re-embedded
    # Same content, new metadata: replaced in place, still no new version.
    relabelled = await manager.upload(kb, "doc", v1, content_type="text/plain", metadata={"rev": "b"})
    assert (relabelled.unchanged, relabelled.document.version) == (True, 1)
    assert relabelled.document.metadata["rev"].string_value == "b"
    searcher = clients.searcher([kb])
    assert await searcher.search("old1", [kb], filter_=eq("rev", "b"))

    v2 = "Second version. " + " ".join(f"new{i}" for i in range(20))
    second = await manager.upload(kb, "doc", v2, content_type="text/plain")
    assert (second.unchanged, second.document.version) == (False, 2)
    assert second.document.content_sha256 != first.document.content_sha256
    after = await chunk_rows(database, kb, "doc")
    assert {row["version"] for row in after} == {2}
    assert len(after) == second.chunk_count
    assert (await manager.get_document(kb, "doc")).version == 2
    for passage in await searcher.search("version old1 new1", [kb], top_k=50):
        assert passage.document_version == 2
        assert_cited(passage, v2)
    # Going back to the first content is new content again: version 3.
    assert (await manager.upload(kb, "doc", v1, content_type="text/plain")).document.version == 3


async def test_concurrent_identical_uploads_create_one_version(
    clients: Clients, database: SharedDatabase
) -> None:
    kb, manager = new_ref(), clients.manager()
    await manager.create(kb, FIXED)
    text = "Identical content, uploaded three times at once."
    uploads = [manager.upload(kb, "same.txt", text, content_type="text/plain") for _ in range(3)]
    results = await asyncio.gather(*uploads)
    assert sorted((r.document.version, r.unchanged) for r in results) == [(1, False), (1, True), (1, True)]
    assert {row["version"] for row in await chunk_rows(database, kb, "same.txt")} == {1}


async def test_document_refs_with_quotes_backslashes_and_non_ascii_upload_and_replace(
    clients: Clients,
) -> None:
    # The writer's advisory lock is keyed by the ref's text: no character of it may break that.
    kb, manager = new_ref(), clients.manager()
    await manager.create(kb, FIXED)
    refs = ["it's\\here", 'quote"d', "semi;colon--", "ünï/cödé", "dollar$$tag$$"]
    for ref in refs:
        first = await manager.upload(kb, ref, "First version.", content_type="text/plain")
        again = await manager.upload(
            kb, ref, "First version.", content_type="text/plain", metadata={"m": 1.0}
        )
        second = await manager.upload(kb, ref, "Second version.", content_type="text/plain")
        assert (first.document.version, again.unchanged, second.document.version) == (1, True, 2)
        assert (await manager.get_document(kb, ref)).ref == ref
    assert sorted(d.ref for page in await manager.list_documents(kb, 10) for d in page) == sorted(refs)


async def test_get_list_and_delete_documents(clients: Clients, database: SharedDatabase) -> None:
    kb, manager = new_ref(), clients.manager()
    await manager.create(kb, FIXED, 16)
    refs = ["e.md", "a.md", "d/1.md", "c.md", "b.md"]
    for n, ref in enumerate(refs):
        await manager.upload(kb, ref, f"# Doc {n}\n\n" + " ".join(["word"] * (10 * n + 5)), metadata={"n": n})
    document = await manager.get_document(kb, "c.md")
    assert (document.namespace, document.knowledge_base_ref, document.ref, document.version) == (
        NAMESPACE,
        kb,
        "c.md",
        1,
    )
    assert (document.content_type, document.metadata["n"].number_value) == ("text/markdown", 3.0)
    assert re.fullmatch(r"[0-9a-f]{64}", document.content_sha256)
    pages = await manager.list_documents(kb, 2)
    assert [len(page) for page in pages] == [2, 2, 1]
    assert [d.ref for page in pages for d in page] == sorted(refs)
    assert (await manager.get(kb)).document_count == 5

    chunks = len(await chunk_rows(database, kb, "c.md"))
    assert chunks == document.chunk_count > 1
    assert await manager.delete_document(kb, "c.md") == chunks
    assert await chunk_rows(database, kb, "c.md") == []
    for call in (manager.get_document(kb, "c.md"), manager.delete_document(kb, "c.md")):
        failed = await failure(call)
        assert (failed.code, failed.reason) == (grpc.StatusCode.NOT_FOUND, "NOT_FOUND")
    assert [d.ref for page in await manager.list_documents(kb, 2) for d in page] == sorted(
        set(refs) - {"c.md"}
    )
    remaining = [len(await chunk_rows(database, kb, ref)) for ref in refs]
    assert await row_counts(database, kb) == (1, 4, sum(remaining))


async def test_get_document_returns_the_extracted_text_its_passages_slice(clients: Clients) -> None:
    kb, manager = new_ref(), clients.manager()
    await manager.create(kb, MARKDOWN)
    html = "<h1>Runbook</h1><p>Restart the ingest worker with care.</p><script>hidden()</script>"
    await manager.upload(kb, "runbook.html", html, content_type="text/html")
    assert (await manager.get_document(kb, "runbook.html")).text == ""  # only when asked for
    document = await manager.get_document(kb, "runbook.html", include_text=True)
    assert document.text == extract_text(html.encode(), "text/html")
    (passage,) = await clients.searcher([kb]).search("ingest worker", [kb], top_k=1)
    assert document.text[passage.start_offset : passage.end_offset] == passage.text
    assert not passage.HasField("location")  # HTML has no pages


async def test_plain_text_offsets_are_code_points_of_the_decoded_upload(clients: Clients) -> None:
    kb, manager = new_ref(), clients.manager()
    await manager.create(kb, FIXED, 16, 4)
    # Multi-byte characters everywhere, so 1 KiB pieces split them and bytes != code points.
    text = "\r\n".join(f"Zürich café {i} — naïve 日本語 façade 🎉 crème brûlée" for i in range(60))
    uploaded = await manager.upload(kb, "menu.txt", "\ufeff" + text, content_type="Text/Plain; charset=UTF-8")
    assert uploaded.document.size_bytes == len(("\ufeff" + text).encode())
    assert uploaded.document.content_type == "text/plain"  # the media type, one of the three
    passages = await clients.searcher([kb]).search("crème brûlée 🎉 42", [kb], top_k=100)
    assert len(passages) == uploaded.chunk_count
    for passage in passages:
        assert_cited(passage, text)  # the byte-order mark is removed, nothing else
        assert passage.heading_path == []


async def test_html_text_is_extracted_and_scripts_are_not_searchable(
    clients: Clients, database: SharedDatabase
) -> None:
    kb, manager = new_ref(), clients.manager()
    await manager.create(kb, MARKDOWN)
    html = (
        "<!doctype html><html><head><title>zebratitle</title><script>var zebrascript = 1;</script>"
        "<style>.zebrastyle { color: red }</style></head><body><h1>Runbook</h1>"
        "<p>Restart the <b>ingest</b> worker with care.</p><script>zebrascript()</script>"
        "<h2>Escalation</h2><ul><li>Page the owner</li><li>Open an incident</li></ul></body></html>"
    )
    uploaded = await manager.upload(kb, "runbook.html", html, content_type="text/html")
    extracted = extract_text(html.encode(), "text/html")
    searcher = clients.searcher([kb])
    passages = await searcher.search("ingest worker escalation", [kb], top_k=10)
    assert passages
    assert len(passages) == uploaded.chunk_count
    for passage in passages:
        assert_cited(passage, extracted)
        assert "<" not in passage.text
    assert any(tuple(p.heading_path) == ("Runbook", "Escalation") for p in passages)
    for hidden in ("zebrascript", "zebrastyle", "zebratitle"):
        for passage in await searcher.search(hidden, [kb], top_k=10):
            assert hidden not in passage.text
            assert passage.text_rank == 0
    async with superuser(database) as conn:
        texts = await conn.fetch(
            "SELECT text FROM chunks WHERE namespace = $1 AND kb_ref = $2", NAMESPACE, kb
        )
    assert texts
    assert not any("zebra" in row["text"] for row in texts)


def header_in(kb: str, content_type: str, doc_ref: str = "doc.txt") -> knowledge_pb2.UploadDocumentRequest:
    return next(upload_stream(kb, doc_ref, b"", content_type=content_type))


BAD_UPLOADS = [
    # (case, content type, the stream: "H" a header ("H#" for document `a#b`), bytes a piece, field)
    ("unsupported type", "image/png", ["H", b"\x89PNG"], "header.content_type"),
    ("bad charset", "text/plain; charset=latin-1", ["H", b"abc"], "header.content_type"),
    ("invalid UTF-8", "text/plain", ["H", b"valid ", b"\xff\xfe bad"], "content"),
    ("no text", "text/plain", ["H", b" \n\t "], "content"),
    ("empty content", "text/plain", ["H"], "content"),
    ("content first", "text/plain", [b"hello", "H"], "header"),
    ("second header", "text/plain", ["H", b"hello", "H"], "header"),
    ("empty stream", "text/plain", [], "header"),
    ("'#' in the document ref", "text/plain", ["H#", b"hello"], "header.document_ref"),
]


@pytest.mark.parametrize(
    ("case", "content_type", "shape", "field"), BAD_UPLOADS, ids=[c[0] for c in BAD_UPLOADS]
)
async def test_bad_uploads_are_invalid_argument_and_store_nothing(
    clients: Clients, database: SharedDatabase, case: str, content_type: str, shape: list[object], field: str
) -> None:
    kb, manager = new_ref(), clients.manager()
    await manager.create(kb, FIXED)
    messages = [
        knowledge_pb2.UploadDocumentRequest(content=part)
        if isinstance(part, bytes)
        else header_in(kb, content_type, "a#b" if part == "H#" else "doc.txt")
        for part in shape
    ]
    failed = await failure(manager.upload_messages(messages))
    assert (failed.code, failed.reason, failed.field_violations) == (INVALID, "INVALID_ARGUMENT", [field]), (
        case
    )
    assert await row_counts(database, kb) == (1, 0, 0)


async def test_unsupported_type_is_refused_even_for_unchanged_content(clients: Clients) -> None:
    kb, manager = new_ref(), clients.manager()
    await manager.create(kb, FIXED)
    await manager.upload(kb, "doc.txt", "same bytes", content_type="text/plain")
    failed = await failure(manager.upload(kb, "doc.txt", "same bytes", content_type="image/png"))
    assert (failed.code, failed.field_violations) == (INVALID, ["header.content_type"])


async def test_upload_over_the_limit_is_payload_too_large_and_stores_nothing(
    start_service: ServiceFactory, dev: DevPaths, database: SharedDatabase
) -> None:
    service = await start_service(knowledge_max_upload_bytes=4096)
    async with open_clients(service, dev) as opened:
        kb, manager = new_ref(), opened.manager()
        await manager.create(kb, FIXED)
        failed = await failure(manager.upload(kb, "big.txt", b"x " * 2048 + b"y", content_type="text/plain"))
        assert (failed.code, failed.reason, failed.field_violations) == (
            INVALID,
            "PAYLOAD_TOO_LARGE",
            ["content"],
        )
        assert await row_counts(database, kb) == (1, 0, 0)
        exact = await manager.upload(kb, "fits.txt", b"x " * 2048, content_type="text/plain")
        assert exact.document.size_bytes == 4096


async def test_missing_knowledge_base_or_document_is_not_found(clients: Clients) -> None:
    manager, missing = clients.manager(), new_ref()
    existing = new_ref()
    await manager.create(existing, FIXED)
    for call in (
        manager.upload(missing, "doc.txt", "hello", content_type="text/plain"),
        manager.get(missing),
        manager.delete(missing),
        manager.list_documents(missing, 10),
        manager.get_document(missing, "doc.txt"),
        manager.delete_document(missing, "doc.txt"),
        manager.get_document(existing, "doc.txt"),
    ):
        failed = await failure(call)
        assert (failed.code, failed.reason) == (grpc.StatusCode.NOT_FOUND, "NOT_FOUND")


# --- corpora -------------------------------------------------------------------------------------


async def test_delete_knowledge_base_removes_every_row_and_is_audited(
    clients: Clients, database: SharedDatabase
) -> None:
    manager = clients.manager()
    doomed, kept = new_ref(), new_ref()
    for kb in (doomed, kept):
        await manager.create(kb, MARKDOWN, 32)
        for doc in ("one.md", "two.md"):
            await manager.upload(kb, doc, HANDBOOK_TEXT[:3000])
    await manager.upload(doomed, "one.md", HANDBOOK_TEXT[:2000])  # a second version
    assert (await row_counts(database, doomed))[:2] == (1, 2)
    kept_before = await row_counts(database, kept)

    assert await manager.delete(doomed) == 2
    assert await row_counts(database, doomed) == (0, 0, 0)
    assert await row_counts(database, kept) == kept_before
    failed = await failure(manager.get(doomed))
    assert failed.code == grpc.StatusCode.NOT_FOUND
    assert await clients.searcher([doomed, kept]).search("handbook", [doomed]) == []
    # The ref is free again, for any configuration.
    assert (await manager.create(doomed, FIXED)).created

    async with superuser(database) as conn:
        events = await conn.fetch(
            "SELECT kind, actor, outcome FROM audit_events WHERE target = $1 ORDER BY id",
            f"{NAMESPACE}/{doomed}",
        )
    assert [tuple(event) for event in events] == [
        ("knowledge_base_creation", CONTROL_PLANE_SPIFFE_ID, "succeeded"),
        ("knowledge_base_deletion", CONTROL_PLANE_SPIFFE_ID, "succeeded"),
        ("knowledge_base_creation", CONTROL_PLANE_SPIFFE_ID, "succeeded"),
    ]


async def test_list_knowledge_bases_pages_in_ref_order_and_admins_manage_too(clients: Clients) -> None:
    prefix = new_ref("kbl")
    refs = [f"{prefix}-{n}" for n in range(5)]
    admin = clients.manager("admin")
    for ref in reversed(refs):
        await admin.create(ref, RECURSIVE, display_name=f"name {ref}")
    pages = await clients.manager().list_bases(2)
    listed = [base for page in pages for base in page]
    assert all(len(page) <= 2 for page in pages)
    assert [b.ref for b in listed] == sorted(b.ref for b in listed)
    mine = [b for b in listed if b.ref.startswith(prefix)]
    assert [(b.ref, b.display_name) for b in mine] == [(r, f"name {r}") for r in refs]
    assert await admin.delete(refs[0]) == 0


# --- atomic version swap -------------------------------------------------------------------------


def version_text(word: str, tag: str, chunks: int) -> str:
    """`chunks` sentences of 16 words, each starting with `word` (FIXED 16/0: one chunk each)."""
    sentences = (
        f"{word} {tag} sentence {i} " + " ".join(f"{tag}{i}w{j}" for j in range(12)) + "."
        for i in range(chunks)
    )
    return " ".join(sentences)


async def test_concurrent_searches_never_see_a_mix_of_versions_or_nothing(clients: Clients) -> None:
    kb, manager = new_ref(), clients.manager()
    await manager.create(kb, FIXED, 16)
    contents = {
        "alpha": version_text("alphaversion", "one", 20),
        "beta": version_text("betaversion", "two", 27),
        "gamma": version_text("alphaversion", "three", 14),
    }
    await manager.upload(kb, "doc", contents["alpha"], content_type="text/plain")
    # Version n holds: 1 alpha, then beta (even) and gamma (odd) alternately.
    by_version = {1: contents["alpha"]} | {
        v: contents["beta" if v % 2 == 0 else "gamma"] for v in range(2, 8)
    }
    searchers = [clients.searcher([kb]) for _ in range(4)]
    done = asyncio.Event()
    results: list[list[knowledge_pb2.Passage]] = []

    async def upload_versions() -> None:
        for version in range(2, 8):
            response = await manager.upload(kb, "doc", by_version[version], content_type="text/plain")
            assert response.document.version == version
            await asyncio.sleep(0.01)
        done.set()

    async def search(searcher: Searcher) -> None:
        for _ in range(60):
            passages = await searcher.search("alphaversion betaversion", [kb], top_k=100)
            results.append(passages)
            if done.is_set() and len(results) >= 100:
                return

    await asyncio.gather(upload_versions(), *(search(s) for s in searchers))
    assert len(results) >= 100
    seen_versions = set()
    for passages in results:
        assert passages, "a search saw no version at all"
        versions = {p.document_version for p in passages}
        assert len(versions) == 1, f"a search saw a mix of versions {sorted(versions)}"
        (version,) = versions
        seen_versions.add(version)
        text = by_version[version]
        assert sorted(p.chunk_index for p in passages) == list(range(text.count(".")))
        for passage in passages:
            assert_cited(passage, text)
    assert len(seen_versions) >= 3


# --- remembered pins -----------------------------------------------------------------------------


async def test_a_search_sees_a_base_recreated_with_another_embedder_by_another_replica(
    start_service: ServiceFactory, dev: DevPaths, tmp_path: Path
) -> None:
    # Replica A remembers the bases' pins from its last search; replica B replaces the base (a
    # new embedder and dimension) and creates a second one of the roster meanwhile. A's next
    # search must notice both in its own transaction: no dimension error, no stale corpus.
    config = tmp_path / "embedders.toml"
    config.write_text('[embedders.hash128]\nkind = "hash"\ndimension = 128\n', encoding="utf-8")
    a = await start_service(embedders_file=config)
    b = await start_service(embedders_file=config)
    kb, later = new_ref(), new_ref()
    async with open_clients(a, dev) as on_a, open_clients(b, dev) as on_b:
        await on_a.manager().create(kb, MARKDOWN, embedder="hash")
        await on_a.manager().upload(kb, "old.md", "# Old\n\nalpha words from the first corpus")
        searcher = on_a.searcher([kb, later])
        assert [p.document_ref for p in await searcher.search("alpha words")] == ["old.md"]

        manager_b = on_b.manager()
        await manager_b.delete(kb)
        assert (await manager_b.create(kb, MARKDOWN, embedder="hash128")).knowledge_base.dimension == 128
        await manager_b.upload(kb, "new.md", "# New\n\nbeta words from the second corpus")
        await manager_b.create(later, MARKDOWN, embedder="hash")
        await manager_b.upload(later, "later.md", "# Later\n\ngamma words from a base created after")

        found = {p.document_ref for p in await searcher.search("beta gamma words", top_k=10)}
        assert found == {"new.md", "later.md"}
        vector = await searcher.search("beta words", mode=VECTOR)
        assert vector[0].document_ref == "new.md"
        assert {p.document_ref for p in vector} <= {"new.md", "later.md"}
