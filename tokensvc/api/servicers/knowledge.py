"""KnowledgeService: thin decode -> one domain call -> encode."""

from __future__ import annotations

import typing as _t

import grpc

from tokensvc.errors import NotImplementedRpc
from tokensvc.v1 import knowledge_pb2, knowledge_pb2_grpc

__all__ = ["KnowledgeServicer"]

_Context = grpc.aio.ServicerContext[_t.Any, _t.Any]


class KnowledgeServicer(knowledge_pb2_grpc.KnowledgeServiceServicer):
    """KnowledgeService: managed corpora."""

    async def CreateKnowledgeBase(
        self, request: knowledge_pb2.CreateKnowledgeBaseRequest, context: _Context
    ) -> knowledge_pb2.CreateKnowledgeBaseResponse:
        raise NotImplementedRpc("CreateKnowledgeBase is not implemented yet")

    async def GetKnowledgeBase(
        self, request: knowledge_pb2.GetKnowledgeBaseRequest, context: _Context
    ) -> knowledge_pb2.GetKnowledgeBaseResponse:
        raise NotImplementedRpc("GetKnowledgeBase is not implemented yet")

    async def ListKnowledgeBases(
        self, request: knowledge_pb2.ListKnowledgeBasesRequest, context: _Context
    ) -> knowledge_pb2.ListKnowledgeBasesResponse:
        raise NotImplementedRpc("ListKnowledgeBases is not implemented yet")

    async def DeleteKnowledgeBase(
        self, request: knowledge_pb2.DeleteKnowledgeBaseRequest, context: _Context
    ) -> knowledge_pb2.DeleteKnowledgeBaseResponse:
        raise NotImplementedRpc("DeleteKnowledgeBase is not implemented yet")

    async def UploadDocument(
        self, request: _t.AsyncIterator[knowledge_pb2.UploadDocumentRequest], context: _Context
    ) -> knowledge_pb2.UploadDocumentResponse:
        raise NotImplementedRpc("UploadDocument is not implemented yet")

    async def GetDocument(
        self, request: knowledge_pb2.GetDocumentRequest, context: _Context
    ) -> knowledge_pb2.GetDocumentResponse:
        raise NotImplementedRpc("GetDocument is not implemented yet")

    async def ListDocuments(
        self, request: knowledge_pb2.ListDocumentsRequest, context: _Context
    ) -> knowledge_pb2.ListDocumentsResponse:
        raise NotImplementedRpc("ListDocuments is not implemented yet")

    async def DeleteDocument(
        self, request: knowledge_pb2.DeleteDocumentRequest, context: _Context
    ) -> knowledge_pb2.DeleteDocumentResponse:
        raise NotImplementedRpc("DeleteDocument is not implemented yet")

    async def SearchKnowledge(
        self, request: knowledge_pb2.SearchKnowledgeRequest, context: _Context
    ) -> knowledge_pb2.SearchKnowledgeResponse:
        raise NotImplementedRpc("SearchKnowledge is not implemented yet")
