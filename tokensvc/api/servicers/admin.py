"""AdminService: thin decode -> one domain call -> encode."""

from __future__ import annotations

import typing as _t

import grpc

from tokensvc.errors import NotImplementedRpc
from tokensvc.v1 import admin_pb2, admin_pb2_grpc

__all__ = ["AdminServicer"]

_Context = grpc.aio.ServicerContext[_t.Any, _t.Any]


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
