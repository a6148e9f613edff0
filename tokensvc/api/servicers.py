"""Registration of the tokensvc.v1 servicers on a server.

Each servicer is thin: decode, one domain call, encode. RPCs not built yet fall through to the
generated base class, which raises NotImplementedError; the edge answers UNIMPLEMENTED with the
NOT_IMPLEMENTED reason.
"""

from __future__ import annotations

import typing as _t

import grpc

from tokensvc.errors import NotImplementedRpc
from tokensvc.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    capability_pb2,
    capability_pb2_grpc,
    knowledge_pb2,
    knowledge_pb2_grpc,
    memory_pb2,
    memory_pb2_grpc,
)

__all__ = ["register_servicers", "service_names"]

_Context = grpc.aio.ServicerContext[_t.Any, _t.Any]


class CapabilityServicer(capability_pb2_grpc.CapabilityServiceServicer):
    """CapabilityService: verify, derive session keys, issue, revoke."""

    async def VerifyCapability(
        self, request: capability_pb2.VerifyCapabilityRequest, context: _Context
    ) -> capability_pb2.VerifyCapabilityResponse:
        raise NotImplementedRpc("VerifyCapability is not implemented yet")

    async def DeriveSessionKey(
        self, request: capability_pb2.DeriveSessionKeyRequest, context: _Context
    ) -> capability_pb2.DeriveSessionKeyResponse:
        raise NotImplementedRpc("DeriveSessionKey is not implemented yet")

    async def IssueCapability(
        self, request: capability_pb2.IssueCapabilityRequest, context: _Context
    ) -> capability_pb2.IssueCapabilityResponse:
        raise NotImplementedRpc("IssueCapability is not implemented yet")

    async def RevokeCapability(
        self, request: capability_pb2.RevokeCapabilityRequest, context: _Context
    ) -> capability_pb2.RevokeCapabilityResponse:
        raise NotImplementedRpc("RevokeCapability is not implemented yet")


class MemoryServicer(memory_pb2_grpc.MemoryServiceServicer):
    """MemoryService: long-term memory."""

    async def Remember(
        self, request: memory_pb2.RememberRequest, context: _Context
    ) -> memory_pb2.RememberResponse:
        raise NotImplementedRpc("Remember is not implemented yet")

    async def SearchMemories(
        self, request: memory_pb2.SearchMemoriesRequest, context: _Context
    ) -> memory_pb2.SearchMemoriesResponse:
        raise NotImplementedRpc("SearchMemories is not implemented yet")

    async def GetMemory(
        self, request: memory_pb2.GetMemoryRequest, context: _Context
    ) -> memory_pb2.GetMemoryResponse:
        raise NotImplementedRpc("GetMemory is not implemented yet")

    async def ListMemories(
        self, request: memory_pb2.ListMemoriesRequest, context: _Context
    ) -> memory_pb2.ListMemoriesResponse:
        raise NotImplementedRpc("ListMemories is not implemented yet")

    async def UpdateMemory(
        self, request: memory_pb2.UpdateMemoryRequest, context: _Context
    ) -> memory_pb2.UpdateMemoryResponse:
        raise NotImplementedRpc("UpdateMemory is not implemented yet")

    async def Forget(self, request: memory_pb2.ForgetRequest, context: _Context) -> memory_pb2.ForgetResponse:
        raise NotImplementedRpc("Forget is not implemented yet")

    async def ForgetAll(
        self, request: memory_pb2.ForgetAllRequest, context: _Context
    ) -> memory_pb2.ForgetAllResponse:
        raise NotImplementedRpc("ForgetAll is not implemented yet")


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


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    """AdminService: credential rotation, trust bundle reload, audit."""

    async def RotateDatabaseCredentials(
        self, request: admin_pb2.RotateDatabaseCredentialsRequest, context: _Context
    ) -> admin_pb2.RotateDatabaseCredentialsResponse:
        raise NotImplementedRpc("RotateDatabaseCredentials is not implemented yet")

    async def GetCredentialStatus(
        self, request: admin_pb2.GetCredentialStatusRequest, context: _Context
    ) -> admin_pb2.GetCredentialStatusResponse:
        raise NotImplementedRpc("GetCredentialStatus is not implemented yet")

    async def ReloadTrustBundle(
        self, request: admin_pb2.ReloadTrustBundleRequest, context: _Context
    ) -> admin_pb2.ReloadTrustBundleResponse:
        raise NotImplementedRpc("ReloadTrustBundle is not implemented yet")

    async def ListAuditEvents(
        self, request: admin_pb2.ListAuditEventsRequest, context: _Context
    ) -> admin_pb2.ListAuditEventsResponse:
        raise NotImplementedRpc("ListAuditEvents is not implemented yet")


def register_servicers(server: grpc.aio.Server) -> None:
    capability_pb2_grpc.add_CapabilityServiceServicer_to_server(CapabilityServicer(), server)
    memory_pb2_grpc.add_MemoryServiceServicer_to_server(MemoryServicer(), server)
    knowledge_pb2_grpc.add_KnowledgeServiceServicer_to_server(KnowledgeServicer(), server)
    admin_pb2_grpc.add_AdminServiceServicer_to_server(AdminServicer(), server)


def service_names() -> list[str]:
    """Full names of the tokensvc.v1 services, for health and reflection."""
    return [
        module.DESCRIPTOR.services_by_name[name].full_name
        for module, name in (
            (capability_pb2, "CapabilityService"),
            (memory_pb2, "MemoryService"),
            (knowledge_pb2, "KnowledgeService"),
            (admin_pb2, "AdminService"),
        )
    ]
