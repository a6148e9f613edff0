"""MemoryService: thin decode -> one domain call -> encode."""

from __future__ import annotations

import typing as _t

import grpc

from tokensvc.errors import NotImplementedRpc
from tokensvc.v1 import memory_pb2, memory_pb2_grpc

__all__ = ["MemoryServicer"]

_Context = grpc.aio.ServicerContext[_t.Any, _t.Any]


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
