"""`tokensvc kb create|list|upload|documents|delete|search` — knowledge bases from the terminal."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokensvc.cli.capability_commands import add_capability_source, read_capability
from tokensvc.cli.connection import RpcFailed, add_connection_flags, call_service, client_for
from tokensvc.cli.output import SEARCH_MODES, add_search_mode, draw_progress, output
from tokensvc.client import CallFailed
from tokensvc.knowledge.formats import OCTET_STREAM, media_type_for_filename
from tokensvc.v1 import knowledge_pb2

__all__ = ["CHUNKING_KINDS", "add_knowledge_commands"]

_PIECE = 1024 * 1024
CHUNKING_KINDS = {
    "fixed": knowledge_pb2.CHUNKING_KIND_FIXED,
    "recursive": knowledge_pb2.CHUNKING_KIND_RECURSIVE,
    "markdown": knowledge_pb2.CHUNKING_KIND_MARKDOWN,
}


def add_knowledge_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    kb = commands.add_parser("kb", help="knowledge bases: create, upload, search")
    sub = kb.add_subparsers(dest="kb_command", required=True, metavar="COMMAND")

    create = sub.add_parser(
        "create", help="create a knowledge base (control plane)", description="CreateKnowledgeBase."
    )
    create.add_argument("ref", metavar="REF")
    create.add_argument("--embedder", default="", help="a configured embedder (default: the server's)")
    create.add_argument("--chunking", choices=sorted(CHUNKING_KINDS), required=True)
    create.add_argument("--chunk-size", type=int, default=0, help="words per chunk (16..2048, default 256)")
    create.add_argument("--overlap", type=int, default=0, help="words shared by neighbouring chunks")
    create.add_argument("--display-name", default="")
    create.add_argument(
        "--text-search-config",
        default="",
        help="PostgreSQL text-search configuration to stem with (default: the server's, english)",
    )
    create.set_defaults(handler=_create)

    listing = sub.add_parser(
        "list", help="list knowledge bases (control plane)", description="ListKnowledgeBases."
    )
    listing.set_defaults(handler=_list)

    upload = sub.add_parser(
        "upload",
        help="upload a document (control plane)",
        description="UploadDocument, streamed in 1 MiB pieces; the server ingests it in the background.",
    )
    upload.add_argument("ref", metavar="REF")
    upload.add_argument("file", metavar="FILE", type=Path)
    upload.add_argument("--doc-ref", help="document ref (default: the file name)")
    upload.add_argument(
        "--content-type",
        help="the document's type, e.g. application/pdf (default: from the file name's extension; "
        "without a known one, text/plain, or application/octet-stream for binary content, which the "
        "server recognises by its bytes)",
    )
    upload.add_argument(
        "--wait",
        action="store_true",
        help="follow the document's ingestion with a progress bar until it is searchable; exit 1 if it "
        "fails (without it the command returns once the bytes are stored, the version PENDING)",
    )
    upload.set_defaults(handler=_upload)

    documents = sub.add_parser(
        "documents", help="list a knowledge base's documents", description="ListDocuments."
    )
    documents.add_argument("ref", metavar="REF")
    documents.set_defaults(handler=_documents)

    delete = sub.add_parser(
        "delete", help="delete a knowledge base and all its documents", description="DeleteKnowledgeBase."
    )
    delete.add_argument("ref", metavar="REF")
    delete.set_defaults(handler=_delete)

    search = sub.add_parser(
        "search", help="search knowledge bases (launcher, capability)", description="SearchKnowledge."
    )
    search.add_argument("query", metavar="QUERY")
    search.add_argument(
        "--kb", action="append", default=[], metavar="REF", help="(repeatable; default: the roster)"
    )
    search.add_argument("-k", "--top-k", type=int, default=5)
    add_search_mode(search)
    add_capability_source(search)
    search.set_defaults(handler=_search)

    for parser in (create, listing, upload, documents, delete):
        parser.add_argument(
            "--namespace", default="default", help="namespace of the knowledge base (default: default)"
        )
    for parser in (create, listing, upload, documents, delete, search):
        parser.add_argument("--json", action="store_true", help="print the response as JSON")
        add_connection_flags(parser)


def _manage(args: argparse.Namespace, method: str, request: Any) -> Any:
    return call_service(args, "control-plane", "KnowledgeService", method, request)


def _create(args: argparse.Namespace) -> int:
    request = knowledge_pb2.CreateKnowledgeBaseRequest(
        namespace=args.namespace,
        ref=args.ref,
        display_name=args.display_name,
        embedder=args.embedder,
        text_search_config=args.text_search_config,
        chunking=knowledge_pb2.ChunkingStrategy(
            kind=CHUNKING_KINDS[args.chunking], chunk_size=args.chunk_size, chunk_overlap=args.overlap
        ),
    )
    response = _manage(args, "CreateKnowledgeBase", request)
    base = response.knowledge_base
    verb = "created" if response.created else "already exists (same pinned configuration)"
    return output(
        args, response, f"{base.namespace}/{base.ref} {verb}: embedder {base.embedder}, {args.chunking}"
    )


def _list(args: argparse.Namespace) -> int:
    response = _manage(
        args, "ListKnowledgeBases", knowledge_pb2.ListKnowledgeBasesRequest(namespace=args.namespace)
    )
    lines = [
        f"{b.ref}  embedder={b.embedder}  documents={b.document_count}" for b in response.knowledge_bases
    ]
    return output(args, response, "\n".join(lines) or "(no knowledge bases)")


def _documents(args: argparse.Namespace) -> int:
    request = knowledge_pb2.ListDocumentsRequest(namespace=args.namespace, knowledge_base_ref=args.ref)
    response = _manage(args, "ListDocuments", request)
    lines = [f"{d.ref}  v{d.version}  {_state(d)}  {d.size_bytes} bytes" for d in response.documents]
    return output(args, response, "\n".join(lines) or "(no documents)")


def _state(document: knowledge_pb2.Document) -> str:
    """A version's state as `kb documents` and `kb upload` print it."""
    match document.state:
        case knowledge_pb2.DOCUMENT_STATE_READY:
            text = f"ready, {document.chunk_count} chunks"
        case knowledge_pb2.DOCUMENT_STATE_PROCESSING:
            text = f"processing {document.chunks_done}/{document.chunk_count} chunks"
        case knowledge_pb2.DOCUMENT_STATE_FAILED:
            text = f"failed: {document.failure_reason}"
        case _:
            text = "pending"
    if document.state != knowledge_pb2.DOCUMENT_STATE_READY and document.searchable_version:
        text += f" (v{document.searchable_version} searchable)"
    return text


def _delete(args: argparse.Namespace) -> int:
    request = knowledge_pb2.DeleteKnowledgeBaseRequest(namespace=args.namespace, ref=args.ref)
    response = _manage(args, "DeleteKnowledgeBase", request)
    return output(args, response, f"deleted {args.ref} with {response.deleted_document_count} documents")


def _upload(args: argparse.Namespace) -> int:
    path: Path = args.file
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    content_type = args.content_type or media_type_for_filename(path.name) or _unnamed_type(path)
    header = knowledge_pb2.UploadDocumentHeader(
        namespace=args.namespace,
        knowledge_base_ref=args.ref,
        document_ref=args.doc_ref or path.name,
        content_type=content_type,
    )
    total = path.stat().st_size
    show_progress = total > 4 * _PIECE and sys.stderr.isatty()

    def pieces() -> Iterator[bytes]:
        sent = 0
        with path.open("rb") as handle:
            while piece := handle.read(_PIECE):
                sent += len(piece)
                if show_progress:
                    print(
                        f"\ruploading {sent / _PIECE:.1f} / {total / _PIECE:.1f} MiB", end="", file=sys.stderr
                    )
                yield piece
        if show_progress:
            print(file=sys.stderr)

    async def upload() -> knowledge_pb2.UploadDocumentResponse:
        async with client_for(args, "control-plane") as client:
            return await client.upload_document(header, pieces(), deadline_seconds=max(args.timeout, 600))

    try:
        response = asyncio.run(upload())
    except CallFailed as exc:
        raise RpcFailed(str(exc)) from None
    document = response.document
    if args.wait and document.state not in _ENDED:
        if not args.json:  # with --json, only the document as it ended is printed
            output(args, response, f"{document.ref}: version {document.version} stored, ingesting")
        return _follow(args, document)
    state = "unchanged" if response.unchanged else f"version {document.version}, {_state(document)}"
    return output(args, response, f"{document.ref}: {state}")


_ENDED = (knowledge_pb2.DOCUMENT_STATE_READY, knowledge_pb2.DOCUMENT_STATE_FAILED)


def _follow(args: argparse.Namespace, uploaded: knowledge_pb2.Document) -> int:
    """Poll the document until its version is READY or FAILED (or a newer upload replaced it),
    drawing a progress bar on a terminal; 0 only if it became searchable."""
    request = knowledge_pb2.GetDocumentRequest(
        namespace=uploaded.namespace,
        knowledge_base_ref=uploaded.knowledge_base_ref,
        document_ref=uploaded.ref,
    )
    while True:
        document = _manage(args, "GetDocument", request).document
        ended = document.state in _ENDED or document.version != uploaded.version
        label = knowledge_pb2.DocumentState.Name(document.state).removeprefix("DOCUMENT_STATE_").lower()
        draw_progress(args, document.chunks_done, document.chunk_count, label, final=ended)
        if ended:
            output(args, document, f"{document.ref}: version {document.version}, {_state(document)}")
            return 0 if document.state == knowledge_pb2.DOCUMENT_STATE_READY else 1
        time.sleep(1.0)


def _unnamed_type(path: Path) -> str:
    """A file whose name does not say its type: sent as bytes for the server to recognise (PDF and
    Office files by their signature) when it looks binary, else as plain text."""
    with path.open("rb") as handle:
        head = handle.read(8192)
    return OCTET_STREAM if head.startswith((b"%PDF-", b"PK\x03\x04")) or b"\x00" in head else "text/plain"


def _search(args: argparse.Namespace) -> int:
    request = knowledge_pb2.SearchKnowledgeRequest(
        knowledge_base_refs=args.kb,
        query_text=args.query,
        top_k=args.top_k,
        mode=SEARCH_MODES[args.mode],
    )
    response = call_service(
        args, "launcher", "KnowledgeService", "SearchKnowledge", request, read_capability(args)
    )
    lines = []
    for passage in response.passages:
        heading = " > ".join(passage.heading_path)
        where = _where(passage.location) if passage.HasField("location") else ""
        lines.append(
            f"[{passage.knowledge_base_ref}:{passage.citation}]{where} {passage.score:.4f} {heading}".rstrip()
        )
        lines.append(
            "    " + passage.text[:300].replace("\n", " ") + ("..." if len(passage.text) > 300 else "")
        )
    return output(args, response, "\n".join(lines) or "(no passages)")


def _where(location: knowledge_pb2.PassageLocation) -> str:
    """` p. 3`, ` pp. 3-4`, ` slide 2`, ` Sheet1 rows 10-42`: where a passage is in its file."""

    def span(one: str, many: str, first: int, last: int) -> str:
        return f"{one} {first}" if first == last else f"{many} {first}-{last}"

    parts = []
    if location.first_page:
        parts.append(span("p.", "pp.", location.first_page, location.last_page))
    if location.first_slide:
        parts.append(span("slide", "slides", location.first_slide, location.last_slide))
    if location.first_row:
        rows = span("row", "rows", location.first_row, location.last_row)
        parts.append(f"{location.sheet} {rows}" if location.sheet else rows)
    return "".join(f" {part}" for part in parts)
