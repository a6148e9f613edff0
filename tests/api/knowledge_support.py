"""Helpers for the KnowledgeService end-to-end tests: clients, upload streams, capabilities, the DB.

Management calls go over the control-plane (or admin) certificate and name the namespace;
searches go over a launcher certificate with a freshly minted capability whose `kbs` claim is the
roster. Every test uses its own knowledge-base refs (`kb-<8 hex>`), so the shared database's other
contents never matter.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest

from tests.support import (
    RpcFailure,
    SharedDatabase,
    dev_capability,
    failure_of,
    mtls_channel,
    role_channel,
    superuser,
)
from tokensvc.app import Service
from tokensvc.auth.devpki import DevPaths
from tokensvc.v1 import common_pb2, knowledge_pb2, knowledge_pb2_grpc

NAMESPACE = "default"
AGENT = "dev-agent"
TIMEOUT = 30.0
PIECE = 1024
HANDBOOK = Path(__file__).resolve().parent.parent / "knowledge" / "fixtures" / "handbook.md"

FIXED = knowledge_pb2.CHUNKING_KIND_FIXED
RECURSIVE = knowledge_pb2.CHUNKING_KIND_RECURSIVE
MARKDOWN = knowledge_pb2.CHUNKING_KIND_MARKDOWN
HYBRID = common_pb2.SEARCH_MODE_HYBRID
VECTOR = common_pb2.SEARCH_MODE_VECTOR


def new_ref(prefix: str = "kb") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def meta(value: str | float | bool) -> common_pb2.MetadataValue:
    if isinstance(value, bool):
        return common_pb2.MetadataValue(bool_value=value)
    if isinstance(value, str):
        return common_pb2.MetadataValue(string_value=value)
    return common_pb2.MetadataValue(number_value=float(value))


def eq(key: str, value: str | float | bool) -> common_pb2.Filter:
    leaf = common_pb2.FieldFilter(key=key, operator=common_pb2.FILTER_OPERATOR_EQ, value=meta(value))
    return common_pb2.Filter(field=leaf)


def upload_stream(
    kb_ref: str,
    doc_ref: str,
    content: bytes,
    *,
    content_type: str = "text/markdown",
    metadata: Mapping[str, str | float | bool] | None = None,
    namespace: str = NAMESPACE,
    piece: int = PIECE,
    wait: bool = True,
) -> Iterator[knowledge_pb2.UploadDocumentRequest]:
    """The header, then the content in `piece`-byte messages. `wait`: the upload returns once
    the version is searchable (these tests search right after), else at once, PENDING."""
    header = knowledge_pb2.UploadDocumentHeader(
        namespace=namespace,
        knowledge_base_ref=kb_ref,
        document_ref=doc_ref,
        content_type=content_type,
        metadata={key: meta(value) for key, value in (metadata or {}).items()},
        wait_until_ready=wait,
    )
    yield knowledge_pb2.UploadDocumentRequest(header=header)
    for start in range(0, len(content), piece):
        yield knowledge_pb2.UploadDocumentRequest(content=content[start : start + piece])


async def failure(call: Awaitable[Any]) -> RpcFailure:
    """The decoded status of a call that must fail."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return failure_of(caught.value)


def mint(dev: DevPaths, kbs: Sequence[str], *, namespace: str = NAMESPACE, agent: str = AGENT) -> str:
    """A capability whose roster (`kbs`) is the given knowledge bases."""
    return dev_capability(dev, namespace=namespace, agent=agent, knowledge_bases=list(kbs))


class Manager:
    """The control plane (or an admin): every management RPC, in namespace `namespace`."""

    def __init__(self, channel: grpc.aio.Channel, namespace: str = NAMESPACE):
        self.stub = knowledge_pb2_grpc.KnowledgeServiceStub(channel)
        self.namespace = namespace

    async def create(
        self,
        ref: str,
        kind: int = MARKDOWN,
        size: int = 0,
        overlap: int = 0,
        *,
        embedder: str = "",
        display_name: str = "",
        chunking: bool = True,
        text_search_config: str = "",
    ) -> knowledge_pb2.CreateKnowledgeBaseResponse:
        request = knowledge_pb2.CreateKnowledgeBaseRequest(
            namespace=self.namespace,
            ref=ref,
            display_name=display_name,
            embedder=embedder,
            text_search_config=text_search_config,
        )
        if chunking:
            strategy = knowledge_pb2.ChunkingStrategy(
                kind=knowledge_pb2.ChunkingKind.ValueType(kind), chunk_size=size, chunk_overlap=overlap
            )
            request.chunking.CopyFrom(strategy)
        return await self.stub.CreateKnowledgeBase(request, timeout=TIMEOUT)

    async def upload(
        self, kb_ref: str, doc_ref: str, content: bytes | str, deadline: float = TIMEOUT, **options: Any
    ) -> knowledge_pb2.UploadDocumentResponse:
        data = content.encode() if isinstance(content, str) else content
        stream = upload_stream(kb_ref, doc_ref, data, namespace=self.namespace, **options)
        return await self.stub.UploadDocument(stream, timeout=deadline)

    async def upload_messages(
        self, messages: Sequence[knowledge_pb2.UploadDocumentRequest]
    ) -> knowledge_pb2.UploadDocumentResponse:
        return await self.stub.UploadDocument(iter(messages), timeout=TIMEOUT)

    async def get(self, ref: str) -> knowledge_pb2.KnowledgeBase:
        request = knowledge_pb2.GetKnowledgeBaseRequest(namespace=self.namespace, ref=ref)
        return (await self.stub.GetKnowledgeBase(request, timeout=TIMEOUT)).knowledge_base

    async def list_bases(self, page_size: int) -> list[list[knowledge_pb2.KnowledgeBase]]:
        pages, token = [], ""
        for _ in range(10_000):
            request = knowledge_pb2.ListKnowledgeBasesRequest(
                namespace=self.namespace, page_size=page_size, page_token=token
            )
            page = await self.stub.ListKnowledgeBases(request, timeout=TIMEOUT)
            pages.append(list(page.knowledge_bases))
            token = page.next_page_token
            if not token:
                return pages
        raise AssertionError("ListKnowledgeBases never returned an empty next_page_token")

    async def delete(self, ref: str) -> int:
        request = knowledge_pb2.DeleteKnowledgeBaseRequest(namespace=self.namespace, ref=ref)
        return int((await self.stub.DeleteKnowledgeBase(request, timeout=TIMEOUT)).deleted_document_count)

    async def get_document(
        self, kb_ref: str, doc_ref: str, *, include_text: bool = False
    ) -> knowledge_pb2.Document:
        request = knowledge_pb2.GetDocumentRequest(
            namespace=self.namespace,
            knowledge_base_ref=kb_ref,
            document_ref=doc_ref,
            include_text=include_text,
        )
        return (await self.stub.GetDocument(request, timeout=TIMEOUT)).document

    async def list_documents(
        self, kb_ref: str, page_size: int, filter_: common_pb2.Filter | None = None
    ) -> list[list[knowledge_pb2.Document]]:
        pages, token = [], ""
        for _ in range(10_000):
            request = knowledge_pb2.ListDocumentsRequest(
                namespace=self.namespace, knowledge_base_ref=kb_ref, page_size=page_size, page_token=token
            )
            if filter_ is not None:
                request.filter.CopyFrom(filter_)
            page = await self.stub.ListDocuments(request, timeout=TIMEOUT)
            pages.append(list(page.documents))
            token = page.next_page_token
            if not token:
                return pages
        raise AssertionError("ListDocuments never returned an empty next_page_token")

    async def delete_document(self, kb_ref: str, doc_ref: str) -> int:
        request = knowledge_pb2.DeleteDocumentRequest(
            namespace=self.namespace, knowledge_base_ref=kb_ref, document_ref=doc_ref
        )
        return int((await self.stub.DeleteDocument(request, timeout=TIMEOUT)).deleted_chunk_count)


class Searcher:
    """A launcher calling SearchKnowledge with one capability."""

    def __init__(self, channel: grpc.aio.Channel, token: str):
        self.stub = knowledge_pb2_grpc.KnowledgeServiceStub(channel)
        self.token = token

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),)

    async def search(
        self,
        query: str,
        refs: Sequence[str] = (),
        *,
        top_k: int = 0,
        mode: int = HYBRID,
        filter_: common_pb2.Filter | None = None,
        min_score: float | None = None,
    ) -> list[knowledge_pb2.Passage]:
        request = knowledge_pb2.SearchKnowledgeRequest(
            knowledge_base_refs=list(refs),
            query_text=query,
            top_k=top_k,
            mode=common_pb2.SearchMode.ValueType(mode),
            min_score=min_score,
        )
        if filter_ is not None:
            request.filter.CopyFrom(filter_)
        response = await self.stub.SearchKnowledge(request, metadata=self.metadata, timeout=TIMEOUT)
        return list(response.passages)


class Clients:
    """Channels to one service by role; every channel is closed by `open_clients`."""

    def __init__(self, service: Service, dev: DevPaths):
        self.service = service
        self.dev = dev
        self.channels: list[grpc.aio.Channel] = []

    def channel(self, role: str) -> grpc.aio.Channel:
        channel = role_channel(self.service.port, self.dev, role)
        self.channels.append(channel)
        return channel

    def manager(self, role: str = "control-plane", namespace: str = NAMESPACE) -> Manager:
        return Manager(self.channel(role), namespace)

    def searcher(
        self,
        kbs: Sequence[str],
        *,
        namespace: str = NAMESPACE,
        certificate: tuple[Path, Path] | None = None,
    ) -> Searcher:
        """A launcher (the dev launcher, or `certificate`) with a capability granting `kbs`."""
        if certificate is None:
            channel = self.channel("launcher")
        else:
            channel = mtls_channel(self.service.port, self.dev.ca_cert, *certificate)
            self.channels.append(channel)
        return Searcher(channel, mint(self.dev, kbs, namespace=namespace))


@asynccontextmanager
async def open_clients(service: Service, dev: DevPaths) -> AsyncIterator[Clients]:
    clients = Clients(service, dev)
    try:
        yield clients
    finally:
        for channel in clients.channels:
            await channel.close(grace=None)


# --- citations --------------------------------------------------------------------------------

_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})")
_HEADING = re.compile(r" {0,3}(#{1,6})[ \t]+(.+?)[ \t]*$")


def headings(text: str) -> list[tuple[int, int, str]]:
    """(line start, level, title) of every ATX heading outside fenced code, in order."""
    found: list[tuple[int, int, str]] = []
    fence = ""
    position = 0
    for line in text.splitlines(keepends=True):
        content = line.rstrip("\r\n")
        opened = _FENCE.match(content)
        if fence:
            if opened and opened.group(1)[0] == fence[0] and len(opened.group(1)) >= len(fence):
                fence = ""
        elif opened:
            fence = opened.group(1)
        elif heading := _HEADING.match(content):
            found.append((position, len(heading.group(1)), heading.group(2)))
        position += len(line)
    return found


def heading_path_at(text: str, offset: int) -> tuple[str, ...]:
    """The titles of the headings enclosing code point `offset` of a Markdown text, outermost first."""
    stack: list[tuple[int, str]] = []
    for start, level, title in headings(text):
        if start > offset:
            break
        while stack and stack[-1][0] >= level:
            stack.pop()
        stack.append((level, title))
    return tuple(title for _, title in stack)


def assert_cited(passage: knowledge_pb2.Passage, document: str) -> None:
    """The passage's citation is `doc#index` and its offsets slice exactly its text out of `document`."""
    assert passage.citation == f"{passage.document_ref}#{passage.chunk_index}"
    assert 0 <= passage.start_offset < passage.end_offset <= len(document)
    assert document[passage.start_offset : passage.end_offset] == passage.text


# --- the database, seen by the superuser (no row-level security) ------------------------------


async def row_counts(
    database: SharedDatabase, kb_ref: str, namespace: str = NAMESPACE
) -> tuple[int, int, int]:
    """Rows of (knowledge_bases, documents, chunks) for one knowledge base."""
    async with superuser(database) as conn:
        row = await conn.fetchrow(
            "SELECT (SELECT count(*) FROM knowledge_bases WHERE namespace = $1 AND ref = $2) AS bases, "
            "(SELECT count(*) FROM documents WHERE namespace = $1 AND kb_ref = $2) AS documents, "
            "(SELECT count(*) FROM chunks WHERE namespace = $1 AND kb_ref = $2) AS chunks",
            namespace,
            kb_ref,
        )
    assert row is not None
    return int(row["bases"]), int(row["documents"]), int(row["chunks"])


async def chunk_rows(
    database: SharedDatabase, kb_ref: str, doc_ref: str, namespace: str = NAMESPACE
) -> list[asyncpg.Record]:
    """Every stored chunk of a document (any version), by version and index."""
    async with superuser(database) as conn:
        return list(
            await conn.fetch(
                "SELECT version, chunk_index, text, start_offset, end_offset, heading_path FROM chunks "
                "WHERE namespace = $1 AND kb_ref = $2 AND doc_ref = $3 ORDER BY version, chunk_index",
                namespace,
                kb_ref,
                doc_ref,
            )
        )
