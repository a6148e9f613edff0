"""KnowledgeService: thin decode -> one domain call -> encode."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from tokensvc.api.context import current_call
from tokensvc.api.convert import current_scope, decode_search_mode
from tokensvc.api.knowledge_codec import (
    decode_chunking,
    decode_doc_ref,
    decode_kb_ref,
    decode_namespace,
    decode_query,
    decode_top_k,
    encode_base,
    encode_document,
    encode_passage,
)
from tokensvc.api.memory_codec import decode_filter, decode_page_size
from tokensvc.api.metadata_codec import metadata_from_proto
from tokensvc.api.page_tokens import decode_ref_position, encode_ref_position, listing_binding
from tokensvc.errors import InvalidArgument, PayloadTooLarge
from tokensvc.knowledge.formats import parse_content_type
from tokensvc.knowledge.service import KnowledgeBases
from tokensvc.memory.metadata import MetadataScalar
from tokensvc.v1 import knowledge_pb2, knowledge_pb2_grpc

__all__ = ["KnowledgeServicer"]

_Context = grpc.aio.ServicerContext[Any, Any]


@dataclass(frozen=True)
class _Header:
    namespace: str
    kb_ref: str
    doc_ref: str
    content_type: str
    metadata: dict[str, MetadataScalar]
    wait: bool


def _decode_header(header: knowledge_pb2.UploadDocumentHeader) -> _Header:
    return _Header(
        decode_namespace(header.namespace, "header.namespace"),
        decode_kb_ref(header.knowledge_base_ref, "header.knowledge_base_ref"),
        decode_doc_ref(header.document_ref, "header.document_ref"),
        # Checked here, not only at extraction: an unchanged upload is never extracted. The
        # media type alone is kept, so Document.content_type is one of the three documented values.
        parse_content_type(header.content_type, "header.content_type"),
        metadata_from_proto(header.metadata, "header.metadata"),
        header.wait_until_ready,
    )


class KnowledgeServicer(knowledge_pb2_grpc.KnowledgeServiceServicer):
    def __init__(self, knowledge: KnowledgeBases, *, max_upload_bytes: int):
        self._knowledge = knowledge
        self._max_upload = max_upload_bytes

    async def CreateKnowledgeBase(
        self, request: knowledge_pb2.CreateKnowledgeBaseRequest, context: _Context
    ) -> knowledge_pb2.CreateKnowledgeBaseResponse:
        if len(request.display_name) > 256:
            raise InvalidArgument("display_name", "must be at most 256 characters")
        if "\x00" in request.display_name:  # PostgreSQL text cannot hold it
            raise InvalidArgument("display_name", "must not contain U+0000 (NUL)")
        base, created = await self._knowledge.create(
            decode_namespace(request.namespace),
            decode_kb_ref(request.ref),
            request.display_name,
            request.embedder,
            decode_chunking(request.chunking, request.HasField("chunking")),
            text_config=request.text_search_config,
            actor=current_call().caller.spiffe_id,
        )
        return knowledge_pb2.CreateKnowledgeBaseResponse(knowledge_base=encode_base(base), created=created)

    async def GetKnowledgeBase(
        self, request: knowledge_pb2.GetKnowledgeBaseRequest, context: _Context
    ) -> knowledge_pb2.GetKnowledgeBaseResponse:
        base = await self._knowledge.get(decode_namespace(request.namespace), decode_kb_ref(request.ref))
        return knowledge_pb2.GetKnowledgeBaseResponse(knowledge_base=encode_base(base))

    async def ListKnowledgeBases(
        self, request: knowledge_pb2.ListKnowledgeBasesRequest, context: _Context
    ) -> knowledge_pb2.ListKnowledgeBasesResponse:
        namespace = decode_namespace(request.namespace)
        limit = decode_page_size(request.page_size)
        binding = listing_binding(namespace)
        after = decode_ref_position(request.page_token, binding)
        bases = await self._knowledge.list_bases(namespace, after=after, limit=limit + 1)
        token = encode_ref_position(bases[limit - 1].ref, binding) if len(bases) > limit else ""
        return knowledge_pb2.ListKnowledgeBasesResponse(
            knowledge_bases=[encode_base(base) for base in bases[:limit]], next_page_token=token
        )

    async def DeleteKnowledgeBase(
        self, request: knowledge_pb2.DeleteKnowledgeBaseRequest, context: _Context
    ) -> knowledge_pb2.DeleteKnowledgeBaseResponse:
        count = await self._knowledge.delete(
            decode_namespace(request.namespace),
            decode_kb_ref(request.ref),
            actor=current_call().caller.spiffe_id,
        )
        return knowledge_pb2.DeleteKnowledgeBaseResponse(deleted_document_count=count)

    async def UploadDocument(
        self, request_iterator: AsyncIterator[knowledge_pb2.UploadDocumentRequest], context: _Context
    ) -> knowledge_pb2.UploadDocumentResponse:
        header: _Header | None = None
        pieces: list[bytes] = []
        size = 0
        async for message in request_iterator:
            part = message.WhichOneof("part")
            if header is None:
                if part != "header":
                    raise InvalidArgument("header", "the first message must be the header")
                header = _decode_header(message.header)  # refuse a bad header before reading on
                continue
            if part != "content":
                raise InvalidArgument("header", "only the first message may be a header")
            size += len(message.content)
            if size > self._max_upload:
                # Refused as soon as the limit is passed, before anything is stored.
                raise PayloadTooLarge("content", f"exceeds the upload limit of {self._max_upload} bytes")
            pieces.append(message.content)
        if header is None:
            raise InvalidArgument("header", "the stream is empty; send a header first")
        result = await self._knowledge.upload(
            header.namespace,
            header.kb_ref,
            header.doc_ref,
            header.content_type,
            header.metadata,
            b"".join(pieces),
            wait=header.wait,
        )
        return knowledge_pb2.UploadDocumentResponse(
            document=encode_document(result.document),
            unchanged=result.unchanged,
            chunk_count=result.document.chunk_count,
        )

    async def GetDocument(
        self, request: knowledge_pb2.GetDocumentRequest, context: _Context
    ) -> knowledge_pb2.GetDocumentResponse:
        document = await self._knowledge.get_document(
            decode_namespace(request.namespace),
            decode_kb_ref(request.knowledge_base_ref, "knowledge_base_ref"),
            decode_doc_ref(request.document_ref),
            with_text=request.include_text,
        )
        return knowledge_pb2.GetDocumentResponse(document=encode_document(document))

    async def ListDocuments(
        self, request: knowledge_pb2.ListDocumentsRequest, context: _Context
    ) -> knowledge_pb2.ListDocumentsResponse:
        namespace = decode_namespace(request.namespace)
        kb_ref = decode_kb_ref(request.knowledge_base_ref, "knowledge_base_ref")
        has_filter = request.HasField("filter")
        filter_ = decode_filter(request.filter, has_filter)
        limit = decode_page_size(request.page_size)
        filter_bytes = request.filter.SerializeToString(deterministic=True) if has_filter else b""
        binding = listing_binding(namespace, kb_ref, filter_bytes)
        after = decode_ref_position(request.page_token, binding)
        documents = await self._knowledge.list_documents(
            namespace, kb_ref, after=after, limit=limit + 1, filter_=filter_
        )
        token = encode_ref_position(documents[limit - 1].ref, binding) if len(documents) > limit else ""
        return knowledge_pb2.ListDocumentsResponse(
            documents=[encode_document(d) for d in documents[:limit]], next_page_token=token
        )

    async def DeleteDocument(
        self, request: knowledge_pb2.DeleteDocumentRequest, context: _Context
    ) -> knowledge_pb2.DeleteDocumentResponse:
        count = await self._knowledge.delete_document(
            decode_namespace(request.namespace),
            decode_kb_ref(request.knowledge_base_ref, "knowledge_base_ref"),
            decode_doc_ref(request.document_ref),
        )
        return knowledge_pb2.DeleteDocumentResponse(deleted_chunk_count=count)

    async def SearchKnowledge(
        self, request: knowledge_pb2.SearchKnowledgeRequest, context: _Context
    ) -> knowledge_pb2.SearchKnowledgeResponse:
        for index, ref in enumerate(request.knowledge_base_refs):
            decode_kb_ref(ref, f"knowledge_base_refs[{index}]")
        min_score = request.min_score if request.HasField("min_score") else None
        if min_score is not None and not math.isfinite(min_score):
            raise InvalidArgument("min_score", "must be a finite number")
        passages = await self._knowledge.search(
            current_scope(),
            list(request.knowledge_base_refs),
            query=decode_query(request.query_text),
            top_k=decode_top_k(request.top_k),
            min_score=min_score,
            filter_=decode_filter(request.filter, request.HasField("filter")),
            mode=decode_search_mode(request.mode, has_text=True),
        )
        return knowledge_pb2.SearchKnowledgeResponse(passages=[encode_passage(p) for p in passages])
