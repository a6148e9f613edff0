"""KnowledgeService request shapes checked at the edge, and domain -> proto encoding."""

from __future__ import annotations

from tokensvc.api.convert import timestamp
from tokensvc.api.memory_codec import DEFAULT_TOP_K, MAX_TOP_K
from tokensvc.api.metadata_codec import metadata_to_proto
from tokensvc.errors import InvalidArgument
from tokensvc.knowledge import BaseRow, DocumentRow, DocumentState, Location
from tokensvc.knowledge.chunking import ChunkingKind, ChunkingStrategy
from tokensvc.knowledge.service import Passage
from tokensvc.names import is_dns_label, is_kb_ref
from tokensvc.v1 import knowledge_pb2

__all__ = [
    "decode_chunking",
    "decode_doc_ref",
    "decode_kb_ref",
    "decode_namespace",
    "decode_query",
    "decode_top_k",
    "encode_base",
    "encode_chunking",
    "encode_document",
    "encode_passage",
]

# SearchKnowledgeRequest.query_text: "at most 8 KiB" (memory queries may be 32 KiB; not this one).
MAX_QUERY_BYTES = 8 * 1024


_KINDS = {
    knowledge_pb2.CHUNKING_KIND_FIXED: ChunkingKind.FIXED,
    knowledge_pb2.CHUNKING_KIND_RECURSIVE: ChunkingKind.RECURSIVE,
    knowledge_pb2.CHUNKING_KIND_MARKDOWN: ChunkingKind.MARKDOWN,
}
_KIND_TO_PROTO = {kind: value for value, kind in _KINDS.items()}


def decode_namespace(value: str, field: str = "namespace") -> str:
    if not is_dns_label(value):
        raise InvalidArgument(field, "must be a DNS-1123 label (lower-case letters, digits, '-'; at most 63)")
    return value


def decode_kb_ref(value: str, field: str = "ref") -> str:
    if not is_kb_ref(value):
        raise InvalidArgument(field, "must be a Kubernetes object name (a-z, 0-9, '-', '.'; at most 253)")
    return value


def decode_doc_ref(value: str, field: str = "document_ref") -> str:
    if not 1 <= len(value) <= 512 or any(ch.isspace() or ord(ch) < 32 or ch in "#\x7f" for ch in value):
        raise InvalidArgument(
            field, "must be 1..512 characters without whitespace, control characters or '#'"
        )
    return value


def decode_chunking(message: knowledge_pb2.ChunkingStrategy, present: bool) -> ChunkingStrategy:
    kind = _KINDS.get(message.kind) if present else None
    if kind is None:
        raise InvalidArgument("chunking.kind", "must be FIXED, RECURSIVE or MARKDOWN")
    return ChunkingStrategy.from_request(kind, message.chunk_size, message.chunk_overlap)


def decode_top_k(value: int) -> int:
    top_k = value or DEFAULT_TOP_K
    if not 1 <= top_k <= MAX_TOP_K:
        raise InvalidArgument("top_k", f"must be between 1 and {MAX_TOP_K}")
    return top_k


def decode_query(value: str) -> str:
    if not value.strip():
        raise InvalidArgument("query_text", "must not be empty")
    if len(value.encode("utf-8", "surrogatepass")) > MAX_QUERY_BYTES:
        raise InvalidArgument("query_text", f"must be at most {MAX_QUERY_BYTES} bytes")
    if "\x00" in value:  # PostgreSQL text cannot hold it; the text ranker would fail on it
        raise InvalidArgument("query_text", "must not contain U+0000 (NUL)")
    return value


def encode_chunking(kind: str, size: int, overlap: int) -> knowledge_pb2.ChunkingStrategy:
    """A stored chunking strategy (kind name, size, overlap)."""
    return knowledge_pb2.ChunkingStrategy(
        kind=_KIND_TO_PROTO[ChunkingKind(kind)], chunk_size=size, chunk_overlap=overlap
    )


def encode_base(base: BaseRow) -> knowledge_pb2.KnowledgeBase:
    return knowledge_pb2.KnowledgeBase(
        namespace=base.namespace,
        ref=base.ref,
        display_name=base.display_name,
        embedder=base.embedder,
        chunking=encode_chunking(base.chunking, base.chunk_size, base.chunk_overlap),
        dimension=base.dimension,
        document_count=base.document_count,
        created_at=timestamp(base.created_at),
        text_search_config=base.text_config,
    )


def encode_document(document: DocumentRow) -> knowledge_pb2.Document:
    return knowledge_pb2.Document(
        namespace=document.namespace,
        knowledge_base_ref=document.kb_ref,
        ref=document.ref,
        version=document.version,
        content_type=document.content_type,
        content_sha256=document.content_sha256.hex(),
        size_bytes=document.size_bytes,
        chunk_count=document.chunk_count,
        metadata=metadata_to_proto(document.metadata),
        created_at=timestamp(document.created_at),
        text=document.text or "",
        state=_DOCUMENT_STATES[document.state],
        chunks_done=document.chunks_done or 0,
        failure_reason=document.failure_reason,
        searchable_version=document.searchable_version or 0,
    )


_DOCUMENT_STATES = {
    DocumentState.PENDING: knowledge_pb2.DOCUMENT_STATE_PENDING,
    DocumentState.PROCESSING: knowledge_pb2.DOCUMENT_STATE_PROCESSING,
    DocumentState.READY: knowledge_pb2.DOCUMENT_STATE_READY,
    DocumentState.FAILED: knowledge_pb2.DOCUMENT_STATE_FAILED,
}


def encode_passage(passage: Passage) -> knowledge_pb2.Passage:
    return knowledge_pb2.Passage(
        text=passage.text,
        score=passage.score,
        knowledge_base_ref=passage.kb_ref,
        citation=passage.citation,
        document_ref=passage.doc_ref,
        chunk_index=passage.chunk_index,
        document_version=passage.version,
        start_offset=passage.start,
        end_offset=passage.end,
        heading_path=list(passage.heading_path),
        vector_rank=passage.vector_rank,
        text_rank=passage.text_rank,
        location=encode_location(passage.location),
    )


def encode_location(location: Location) -> knowledge_pb2.PassageLocation | None:
    """A passage's location; None (unset) where the format has none."""
    if location.empty:
        return None
    return knowledge_pb2.PassageLocation(
        first_page=location.first_page,
        last_page=location.last_page,
        first_slide=location.first_slide,
        last_slide=location.last_slide,
        sheet=location.sheet,
        first_row=location.first_row,
        last_row=location.last_row,
    )
