"""MemoryService: thin decode -> one domain call -> encode."""

from __future__ import annotations

from typing import Any

import grpc

from tokensvc.api.convert import current_scope
from tokensvc.api.memory_codec import (
    decode_content,
    decode_filter,
    decode_id,
    decode_ids,
    decode_page_size,
    decode_remember,
    decode_remove_keys,
    decode_search,
    decode_ttl,
    encode_hits,
    encode_memory,
)
from tokensvc.api.metadata_codec import metadata_from_proto
from tokensvc.api.page_tokens import decode_memory_cursor, encode_memory_cursor, listing_binding
from tokensvc.memory.paging import PageCursor
from tokensvc.memory.service import LongTermMemory
from tokensvc.v1 import memory_pb2, memory_pb2_grpc

__all__ = ["MemoryServicer"]

_Context = grpc.aio.ServicerContext[Any, Any]


class MemoryServicer(memory_pb2_grpc.MemoryServiceServicer):
    def __init__(self, memory: LongTermMemory):
        self._memory = memory

    async def Remember(
        self, request: memory_pb2.RememberRequest, context: _Context
    ) -> memory_pb2.RememberResponse:
        results = await self._memory.remember(current_scope(), decode_remember(request))
        return memory_pb2.RememberResponse(
            results=[memory_pb2.RememberResult(id=i, deduplicated=d) for i, d in results]
        )

    async def SearchMemories(
        self, request: memory_pb2.SearchMemoriesRequest, context: _Context
    ) -> memory_pb2.SearchMemoriesResponse:
        hits = await self._memory.search(current_scope(), decode_search(request))
        return encode_hits(hits)

    async def GetMemory(
        self, request: memory_pb2.GetMemoryRequest, context: _Context
    ) -> memory_pb2.GetMemoryResponse:
        record = await self._memory.get(current_scope(), decode_id(request.id, "id"))
        return memory_pb2.GetMemoryResponse(memory=encode_memory(record))

    async def ListMemories(
        self, request: memory_pb2.ListMemoriesRequest, context: _Context
    ) -> memory_pb2.ListMemoriesResponse:
        has_filter = request.HasField("filter")
        filter_bytes = request.filter.SerializeToString(deterministic=True) if has_filter else b""
        page_size = decode_page_size(request.page_size)
        filter_ = decode_filter(request.filter, has_filter)
        binding = listing_binding(filter_bytes)
        cursor = decode_memory_cursor(request.page_token, binding)
        records, last = await self._memory.list_page(
            current_scope(), page_size=page_size, cursor=cursor, filter_=filter_
        )
        token = "" if last is None else encode_memory_cursor(PageCursor(last.created_at, last.id), binding)
        return memory_pb2.ListMemoriesResponse(
            memories=[encode_memory(record) for record in records], next_page_token=token
        )

    async def UpdateMemory(
        self, request: memory_pb2.UpdateMemoryRequest, context: _Context
    ) -> memory_pb2.UpdateMemoryResponse:
        record = await self._memory.update(
            current_scope(),
            decode_id(request.id, "id"),
            content=decode_content(request.content, "content") if request.HasField("content") else None,
            metadata=metadata_from_proto(request.metadata, "metadata") if request.metadata else None,
            replace_metadata=request.replace_metadata,
            remove_keys=decode_remove_keys(request),
            ttl_seconds=decode_ttl(request.ttl, "ttl") if request.HasField("ttl") else None,
        )
        return memory_pb2.UpdateMemoryResponse(memory=encode_memory(record))

    async def Forget(self, request: memory_pb2.ForgetRequest, context: _Context) -> memory_pb2.ForgetResponse:
        count = await self._memory.forget(current_scope(), decode_ids(request.ids))
        return memory_pb2.ForgetResponse(forgotten_count=count)

    async def ForgetAll(
        self, request: memory_pb2.ForgetAllRequest, context: _Context
    ) -> memory_pb2.ForgetAllResponse:
        count = await self._memory.forget_all(current_scope())
        return memory_pb2.ForgetAllResponse(forgotten_count=count)
