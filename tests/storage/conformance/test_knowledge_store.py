"""KnowledgeStore management: bases pinned once, document counts, versions swapped atomically,
metadata-only replacement, cascade deletes, roster isolation, and concurrent writers."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from tests.storage.conformance.support import (
    DIM,
    axis,
    base_row,
    chunk_rows,
    citation,
    create_base,
    current_document,
    launcher,
    management,
    new_namespace,
    search_chunks,
    sha,
    upload,
    vector_query,
)
from tokensvc.storage.filter_language import Condition, Operator
from tokensvc.storage.ports import KnowledgeStore
from tokensvc.storage.records import NOWHERE, DocumentRow, Location, SourceSpan, Tenant


async def current_chunks(
    store: KnowledgeStore, tenant: Tenant, kb_ref: str
) -> list[tuple[str, str, int, int]]:
    """Every searchable chunk of the knowledge base (identity only), in key order."""
    found = await search_chunks(store, tenant, [kb_ref], vector_query(axis(0), k=1000))
    return sorted(citation(c.item) for c in found)


# --- bases ------------------------------------------------------------------------------------


async def test_a_base_is_created_once_and_keeps_its_pinned_choices(knowledge: KnowledgeStore) -> None:
    ns = new_namespace()
    wanted = base_row(ns, "handbook")

    created, was_created = await knowledge.create_base(management(ns), wanted)
    await upload(knowledge, ns, "handbook", "doc", ["some text"])
    again, created_again = await knowledge.create_base(
        management(ns), base_row(ns, "handbook", dimension=DIM * 2, text_config="english")
    )

    assert (was_created, created_again) == (True, False)
    assert {**vars(created), "created_at": None} == {**vars(wanted), "created_at": None, "document_count": 0}
    assert created.created_at.tzinfo is not None
    assert vars(again) == {**vars(created), "document_count": 1}, "the stored base, counted"


async def test_get_bases_returns_the_requested_bases_in_ref_order_with_document_counts(
    knowledge: KnowledgeStore,
) -> None:
    ns = new_namespace()
    for ref in ("zeta", "alpha", "mid"):
        await create_base(knowledge, ns, ref)
    for doc in ("d1", "d2"):
        await upload(knowledge, ns, "zeta", doc, [f"text of {doc}"])

    bases = await knowledge.get_bases(management(ns), ["zeta", "missing", "alpha", "zeta"])

    assert [(b.ref, b.document_count) for b in bases] == [("alpha", 0), ("zeta", 2)]


async def test_bases_for_search_are_the_visible_bases_read_now_with_nothing_to_check(
    knowledge: KnowledgeStore,
) -> None:
    ns = new_namespace()
    for ref in ("zeta", "alpha", "hidden"):
        await create_base(knowledge, ns, ref)
    tenant = launcher(ns, "zeta", "alpha", "missing")

    bases, expect = await knowledge.bases_for_search(tenant, ["zeta", "alpha", "missing"])

    assert bases == await knowledge.get_bases(tenant, ["zeta", "alpha", "missing"])
    assert [b.ref for b in bases] == ["alpha", "zeta"]
    assert expect is None  # a store reads them in its own transaction: the search checks nothing


async def test_list_bases_pages_in_ref_order_after_the_cursor(knowledge: KnowledgeStore) -> None:
    ns = new_namespace()
    refs = ["b-two", "a-one", "d-four", "c-three", "e-five"]
    for ref in refs:
        await create_base(knowledge, ns, ref)
    await upload(knowledge, ns, "c-three", "doc", ["words"])
    await create_base(knowledge, new_namespace(), "a-zero")  # another namespace's

    first = await knowledge.list_bases(management(ns), after=None, limit=2)
    rest = await knowledge.list_bases(management(ns), after=first[-1].ref, limit=10)

    assert [b.ref for b in first] == ["a-one", "b-two"]
    assert [(b.ref, b.document_count) for b in rest] == [("c-three", 1), ("d-four", 0), ("e-five", 0)]
    assert await knowledge.list_bases(management(ns), after="e-five", limit=10) == []


async def test_delete_base_removes_its_documents_and_chunks_and_counts_the_documents(
    knowledge: KnowledgeStore,
) -> None:
    ns = new_namespace()
    await create_base(knowledge, ns, "doomed")
    await create_base(knowledge, ns, "kept")
    for doc in ("d1", "d2", "d3"):
        await upload(knowledge, ns, "doomed", doc, ["one chunk", "two chunks"])
    await upload(knowledge, ns, "kept", "d1", ["kept chunk"])

    assert await knowledge.delete_base(management(ns), "doomed") == 3
    assert await knowledge.delete_base(management(ns), "doomed") is None

    assert await knowledge.get_bases(management(ns), ["doomed"]) == []
    assert await current_document(knowledge, management(ns), "doomed", "d1") is None
    assert await current_chunks(knowledge, management(ns), "doomed") == []
    assert await current_chunks(knowledge, management(ns), "kept") == [("kept", "d1", 1, 0)]
    # A base created again under the ref starts empty.
    await create_base(knowledge, ns, "doomed")
    assert [b.document_count for b in await knowledge.get_bases(management(ns), ["doomed"])] == [0]
    assert await knowledge.list_documents(management(ns), "doomed", after=None, limit=10, filter_=None) == []
    assert await knowledge.list_documents(management(ns), "never", after=None, limit=10, filter_=None) is None


# --- documents and versions -------------------------------------------------------------------


async def test_the_first_upload_writes_version_one_with_its_chunks(knowledge: KnowledgeStore) -> None:
    ns = new_namespace()
    await create_base(knowledge, ns, "kb")

    stored = await upload(
        knowledge, ns, "kb", "guide", ["first part", "second part"], metadata={"lang": "en"}
    )

    assert stored is not None
    document, written = stored
    assert written is True
    assert (document.namespace, document.kb_ref, document.ref, document.version, document.chunk_count) == (
        ns,
        "kb",
        "guide",
        1,
        2,
    )
    assert (document.content_type, document.content_sha256, document.size_bytes, document.metadata) == (
        "text/plain",
        sha("first part\nsecond part"),
        len("first part\nsecond part"),
        {"lang": "en"},
    )
    assert await current_document(knowledge, management(ns), "kb", "guide") == document
    assert await current_chunks(knowledge, management(ns), "kb") == [
        ("kb", "guide", 1, 0),
        ("kb", "guide", 1, 1),
    ]
    found = await search_chunks(knowledge, management(ns), ["kb"], vector_query(axis(1), k=1))
    passage = found[0].item
    assert (passage.text, passage.start, passage.end, passage.heading_path) == (
        "second part",
        len("first part") + 1,
        len("first part\nsecond part"),
        ("Title", "Part 1"),
    )


async def test_the_same_content_again_replaces_only_the_metadata(knowledge: KnowledgeStore) -> None:
    ns = new_namespace()
    await create_base(knowledge, ns, "kb")
    first = await upload(knowledge, ns, "kb", "guide", ["alpha", "beta"], metadata={"tag": "old"})
    assert first is not None

    # With or without new chunks: the stored version stands and only the metadata changes.
    for chunks, tag in ((["other", "chunks", "ignored"], "new"), (None, "newer")):
        again = await upload(
            knowledge, ns, "kb", "guide", chunks, content="alpha\nbeta", metadata={"tag": tag}
        )
        assert again is not None
        document, written = again
        assert written is False
        assert document == DocumentRow(**{**vars(first[0]), "metadata": {"tag": tag}})
        assert await current_document(knowledge, management(ns), "kb", "guide") == document

    assert await current_chunks(knowledge, management(ns), "kb") == [
        ("kb", "guide", 1, 0),
        ("kb", "guide", 1, 1),
    ]
    tagged = await search_chunks(
        knowledge, management(ns), ["kb"], vector_query(axis(0), k=10), Condition("tag", Operator.EQ, "newer")
    )
    assert len(tagged) == 2, "the chunks are searched with the new metadata"
    assert (
        await search_chunks(
            knowledge,
            management(ns),
            ["kb"],
            vector_query(axis(0), k=10),
            Condition("tag", Operator.EQ, "old"),
        )
        == []
    )


async def test_new_content_writes_the_next_version_and_swaps_every_chunk(knowledge: KnowledgeStore) -> None:
    ns = new_namespace()
    await create_base(knowledge, ns, "kb")
    first = await upload(knowledge, ns, "kb", "guide", ["one", "two", "three"])
    assert first is not None

    second = await upload(knowledge, ns, "kb", "guide", ["uno", "dos"], metadata={"v": 2})

    assert second is not None
    document, written = second
    assert written is True
    assert (document.version, document.chunk_count, document.content_sha256, document.metadata) == (
        2,
        2,
        sha("uno\ndos"),
        {"v": 2},
    )
    assert document.created_at == first[0].created_at, "a document's creation is its first version's"
    assert await current_chunks(knowledge, management(ns), "kb") == [
        ("kb", "guide", 2, 0),
        ("kb", "guide", 2, 1),
    ]
    third = await upload(knowledge, ns, "kb", "guide", ["one", "two", "three"])
    assert third is not None
    assert (third[0].version, third[1]) == (3, True), "old content is a new version, not a revert"


async def test_a_metadata_only_call_for_content_that_changed_writes_nothing(
    knowledge: KnowledgeStore,
) -> None:
    ns = new_namespace()
    await create_base(knowledge, ns, "kb")
    stored = await upload(knowledge, ns, "kb", "guide", ["current text"], metadata={"a": 1})
    assert stored is not None

    assert (
        await upload(knowledge, ns, "kb", "guide", None, content="text the caller believed current") is None
    )
    assert await upload(knowledge, ns, "kb", "absent", None, content="anything") is None

    assert await current_document(knowledge, management(ns), "kb", "guide") == stored[0]
    assert await current_document(knowledge, management(ns), "kb", "absent") is None
    assert await current_chunks(knowledge, management(ns), "kb") == [("kb", "guide", 1, 0)]


async def test_an_empty_document_is_a_version_without_chunks(knowledge: KnowledgeStore) -> None:
    ns = new_namespace()
    await create_base(knowledge, ns, "kb")

    stored = await upload(knowledge, ns, "kb", "empty", [], content="")

    assert stored is not None
    assert (stored[0].version, stored[0].chunk_count, stored[1]) == (1, 0, True)
    assert [b.document_count for b in await knowledge.get_bases(management(ns), ["kb"])] == [1]


async def test_list_documents_pages_in_ref_order_with_the_filter(knowledge: KnowledgeStore) -> None:
    ns = new_namespace()
    await create_base(knowledge, ns, "kb")
    await create_base(knowledge, ns, "other")
    for i, ref in enumerate(["d-3", "d-1", "d-5", "d-2", "d-4"]):
        await upload(
            knowledge, ns, "kb", ref, [f"text {ref}"], metadata={"odd": int(ref[-1]) % 2 == 1, "i": i}
        )
    await upload(knowledge, ns, "other", "d-0", ["elsewhere"])
    tenant = management(ns)

    first = await knowledge.list_documents(tenant, "kb", after=None, limit=2, filter_=None)
    rest = await knowledge.list_documents(tenant, "kb", after="d-2", limit=10, filter_=None)
    odd = await knowledge.list_documents(
        tenant, "kb", after="d-1", limit=10, filter_=Condition("odd", Operator.EQ, True)
    )

    assert [d.ref for d in first] == ["d-1", "d-2"]
    assert [d.ref for d in rest] == ["d-3", "d-4", "d-5"]
    assert [d.ref for d in odd] == ["d-3", "d-5"]
    assert all(d.kb_ref == "kb" for d in [*first, *rest])


async def test_delete_document_returns_its_chunk_count_and_removes_its_chunks(
    knowledge: KnowledgeStore,
) -> None:
    ns = new_namespace()
    await create_base(knowledge, ns, "kb")
    await upload(knowledge, ns, "kb", "gone", ["a", "b", "c"])
    await upload(knowledge, ns, "kb", "kept", ["d"])

    assert await knowledge.delete_document(management(ns), "kb", "gone") == 3
    assert await knowledge.delete_document(management(ns), "kb", "gone") is None

    assert await current_document(knowledge, management(ns), "kb", "gone") is None
    assert await current_chunks(knowledge, management(ns), "kb") == [("kb", "kept", 1, 0)]
    assert [b.document_count for b in await knowledge.get_bases(management(ns), ["kb"])] == [1]


async def test_document_state_reads_the_base_and_its_current_document(knowledge: KnowledgeStore) -> None:
    ns = new_namespace()
    base = await create_base(knowledge, ns, "kb")
    stored = await upload(knowledge, ns, "kb", "doc", ["text"])
    assert stored is not None

    found_base, found_doc = await knowledge.document_state(management(ns), "kb", "doc")
    assert found_base is not None
    assert (found_base.ref, found_base.embedder, found_base.chunking, found_base.created_at) == (
        base.ref,
        base.embedder,
        base.chunking,
        base.created_at,
    )
    assert found_doc == stored[0]
    assert (await knowledge.document_state(management(ns), "kb", "absent"))[1] is None
    assert await knowledge.document_state(management(ns), "missing", "doc") == (None, None)


# --- isolation --------------------------------------------------------------------------------


async def test_a_roster_limits_what_a_tenant_sees(knowledge: KnowledgeStore) -> None:
    ns = new_namespace()
    for ref in ("kb1", "kb2"):
        await create_base(knowledge, ns, ref)
        await upload(knowledge, ns, ref, "doc", [f"text of {ref}"])
    other_ns = new_namespace()
    await create_base(knowledge, other_ns, "kb1")
    await upload(knowledge, other_ns, "kb1", "doc", ["their text"])
    query = vector_query(axis(0), k=10)

    for tenant, visible in (
        (launcher(ns, "kb1"), ["kb1"]),
        (launcher(ns, "kb1", "*"), ["kb1"]),  # `*` means all only as the whole roster
        (launcher(ns, "kb2", "kb1"), ["kb1", "kb2"]),
        (Tenant(ns, knowledge_bases=("*",)), ["kb1", "kb2"]),
        (Tenant(ns), []),
        (launcher(new_namespace(), "*"), []),
    ):
        assert [b.ref for b in await knowledge.get_bases(tenant, ["kb1", "kb2"])] == visible, tenant
        assert [b.ref for b in await knowledge.list_bases(tenant, after=None, limit=10)] == visible, tenant
        for ref in ("kb1", "kb2"):
            shown = ref in visible
            assert (await current_document(knowledge, tenant, ref, "doc") is not None) is shown
            assert (await knowledge.document_state(tenant, ref, "doc") != (None, None)) is shown
            documents = await knowledge.list_documents(tenant, ref, after=None, limit=10, filter_=None)
            assert (documents is not None and len(documents) == 1) is shown
        found = await search_chunks(knowledge, tenant, ["kb1", "kb2"], query)
        assert sorted(c.item.kb_ref for c in found) == visible, tenant
        assert all(c.item.text != "their text" for c in found)

    stranger = launcher(ns, "kb2")
    assert await knowledge.delete_document(stranger, "kb1", "doc") is None
    assert await knowledge.delete_base(stranger, "kb1") is None
    assert await current_document(knowledge, management(ns), "kb1", "doc") is not None


# --- concurrency ------------------------------------------------------------------------------


async def test_concurrent_uploads_of_the_same_content_write_one_version(knowledge: KnowledgeStore) -> None:
    ns = new_namespace()
    await create_base(knowledge, ns, "kb")

    results = await asyncio.gather(*(upload(knowledge, ns, "kb", "doc", ["same", "text"]) for _ in range(5)))

    assert sorted(r[1] for r in results if r is not None) == [False, False, False, False, True]
    assert {r[0].version for r in results if r is not None} == {1}
    assert await current_chunks(knowledge, management(ns), "kb") == [("kb", "doc", 1, 0), ("kb", "doc", 1, 1)]


async def test_concurrent_uploads_of_other_contents_write_one_version_each(knowledge: KnowledgeStore) -> None:
    ns = new_namespace()
    await create_base(knowledge, ns, "kb")
    contents = [[f"version text {i}"] * (i + 1) for i in range(5)]

    results = await asyncio.gather(*(upload(knowledge, ns, "kb", "doc", texts) for texts in contents))

    assert sorted(r[0].version for r in results if r is not None) == [1, 2, 3, 4, 5]
    final = await current_document(knowledge, management(ns), "kb", "doc")
    assert final is not None
    assert final.version == 5
    chunks = await search_chunks(knowledge, management(ns), ["kb"], vector_query(axis(0), k=100))
    assert {c.item.version for c in chunks} == {5}
    assert len(chunks) == final.chunk_count
    assert {"\n".join(c.item.text for c in sorted(chunks, key=lambda c: c.item.chunk_index))} == {
        "\n".join(texts) for texts in contents if sha("\n".join(texts)) == final.content_sha256
    }


async def test_readers_during_version_swaps_see_exactly_one_version(knowledge: KnowledgeStore) -> None:
    ns = new_namespace()
    await create_base(knowledge, ns, "kb")
    await upload(knowledge, ns, "kb", "doc", ["v0 a", "v0 b", "v0 c"])
    seen: list[set[int]] = []

    async def read() -> None:
        for _ in range(10):
            found = await search_chunks(knowledge, management(ns), ["kb"], vector_query(axis(0), k=100))
            seen.append({c.item.version for c in found})
            assert len(found) == 3

    async def write() -> None:
        for i in range(1, 6):
            await upload(knowledge, ns, "kb", "doc", [f"v{i} a", f"v{i} b", f"v{i} c"])

    await asyncio.gather(read(), read(), write())

    assert all(len(versions) == 1 for versions in seen)


async def test_concurrent_creates_of_one_ref_create_it_once(knowledge: KnowledgeStore) -> None:
    ns = new_namespace()

    results = await asyncio.gather(
        *(knowledge.create_base(management(ns), base_row(ns, "contended")) for _ in range(5))
    )

    assert sorted(created for _, created in results) == [False, False, False, False, True]
    assert len({base.created_at for base, _ in results}) == 1


@pytest.mark.parametrize("refs", [["kb"], ["kb", "other"]])
async def test_document_counts_follow_uploads_and_deletes(knowledge: KnowledgeStore, refs: list[str]) -> None:
    ns = new_namespace()
    for ref in refs:
        await create_base(knowledge, ns, ref)
    await upload(knowledge, ns, "kb", "a", ["x"])
    await upload(knowledge, ns, "kb", "b", ["y"])
    await upload(knowledge, ns, "kb", "a", ["x changed"])  # a new version is still one document
    await knowledge.delete_document(management(ns), "kb", "b")

    counts = {b.ref: b.document_count for b in await knowledge.get_bases(management(ns), refs)}

    assert counts == {ref: (1 if ref == "kb" else 0) for ref in refs}


# --- locations and extracted text -------------------------------------------------------------


async def test_a_chunks_location_and_the_documents_text_come_back_as_written(
    knowledge: KnowledgeStore,
) -> None:
    ns = new_namespace()
    await create_base(knowledge, ns, "kb")
    text = "page one text\n\npage two text"
    located = [
        replace(chunk, location=where)
        for chunk, where in zip(
            chunk_rows(["page one text", "page two text"]),
            (Location(first_page=1, last_page=1), Location(first_page=1, last_page=2)),
            strict=True,
        )
    ]
    stored = await knowledge.replace_document(
        management(ns),
        kb_ref="kb",
        ref="manual.pdf",
        content_type="application/pdf",
        content_sha256=sha(text),
        size_bytes=len(text),
        metadata={},
        chunks=located,
        text=text,
        source_spans=(SourceSpan(0, 13, page=1), SourceSpan(15, 28, page=2)),
    )
    assert stored is not None
    document = stored[0]

    found = await search_chunks(knowledge, management(ns), ["kb"], vector_query(axis(1), k=2))
    assert {c.item.chunk_index: c.item.location for c in found} == {
        0: Location(first_page=1, last_page=1),
        1: Location(first_page=1, last_page=2),
    }
    assert await knowledge.document_text(management(ns), "kb", "manual.pdf", document.version) == text
    # Only the current version's: an older one, or a document of another tenant, has none.
    assert await knowledge.document_text(management(ns), "kb", "manual.pdf", document.version + 1) is None
    assert await knowledge.document_text(management(new_namespace()), "kb", "manual.pdf", 1) is None


async def test_a_chunk_without_a_location_has_none(knowledge: KnowledgeStore) -> None:
    ns = new_namespace()
    await create_base(knowledge, ns, "kb")
    await upload(knowledge, ns, "kb", "notes", ["plain text"])
    found = await search_chunks(knowledge, management(ns), ["kb"], vector_query(axis(0), k=1))
    assert found[0].item.location == NOWHERE
    assert found[0].item.location.empty
