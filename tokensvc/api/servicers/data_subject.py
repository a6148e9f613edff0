"""DataSubjectService: an end-user's erasure and export across agents (thin: decode, one call,
encode). The user id goes from the request to the domain call and nowhere else: not into a log
line, a span attribute, an error message or a response."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from tokensvc.api.context import current_call
from tokensvc.api.convert import decode_uuid, set_timestamp
from tokensvc.api.metadata_codec import set_metadata
from tokensvc.errors import InvalidArgument
from tokensvc.memory.data_subjects import DataSubjectReceipt, DataSubjectRequests, ExportItem, ReceiptKind
from tokensvc.names import is_dns_label
from tokensvc.v1 import data_subject_pb2, data_subject_pb2_grpc

__all__ = ["DataSubjectServicer"]

_Context = grpc.aio.ServicerContext[Any, Any]
_KINDS = {
    ReceiptKind.ERASURE: data_subject_pb2.DATA_SUBJECT_REQUEST_KIND_ERASURE,
    ReceiptKind.EXPORT: data_subject_pb2.DATA_SUBJECT_REQUEST_KIND_EXPORT,
}


_MAX_AGENTS = 1000


def _namespace(value: str) -> str:
    if value and not is_dns_label(value):
        raise InvalidArgument("namespace", "must be a DNS label, or empty for every namespace")
    return value


def _agents(values: Sequence[str], namespace: str) -> list[str]:
    if values and not namespace:
        raise InvalidArgument("agents", "need a namespace")
    if len(values) > _MAX_AGENTS:
        raise InvalidArgument("agents", f"at most {_MAX_AGENTS}")
    for index, agent in enumerate(values):
        if not is_dns_label(agent):
            raise InvalidArgument(f"agents[{index}]", "must be a DNS label")
    return list(values)


def encode_receipt(receipt: DataSubjectReceipt) -> data_subject_pb2.DataSubjectReceipt:
    message = data_subject_pb2.DataSubjectReceipt(
        id=receipt.id,
        kind=_KINDS[receipt.kind],
        namespace=receipt.namespace,
        memories=receipt.memories,
        per_agent=[
            data_subject_pb2.AgentMemoryCount(namespace=a.namespace, agent=a.agent, memories=a.memories)
            for a in receipt.per_agent
        ],
        agents=receipt.agents,
        session_key_prefixes=receipt.key_prefixes,
        actor=receipt.actor,
        complete=receipt.complete,
    )
    if receipt.created_at is not None:
        set_timestamp(message.created_at, receipt.created_at)
    return message


def _export_message(item: ExportItem) -> data_subject_pb2.ExportEndUserResponse:
    response = data_subject_pb2.ExportEndUserResponse(resume_token=item.resume_token)
    if item.memory is not None:
        exported, memory = response.memory, item.memory.memory
        exported.namespace = item.memory.namespace
        exported.agent = item.memory.agent
        exported.id = memory.id
        exported.content = memory.content
        set_metadata(exported.metadata, memory.metadata)
        set_timestamp(exported.created_at, memory.created_at)
        set_timestamp(exported.updated_at, memory.updated_at)
        if memory.expires_at is not None:
            set_timestamp(exported.expires_at, memory.expires_at)
    elif item.key_prefix is not None:
        response.session_key_prefix = item.key_prefix
    elif item.receipt is not None:
        response.receipt.CopyFrom(encode_receipt(item.receipt))
    return response


class DataSubjectServicer(data_subject_pb2_grpc.DataSubjectServiceServicer):
    def __init__(self, requests: DataSubjectRequests):
        self._requests = requests

    async def EraseEndUser(
        self, request: data_subject_pb2.EraseEndUserRequest, context: _Context
    ) -> data_subject_pb2.EraseEndUserResponse:
        namespace = _namespace(request.namespace)
        erasure = await self._requests.erase(
            namespace,
            request.user_id,
            actor=current_call().caller.spiffe_id,
            extra_agents=_agents(request.agents, namespace),
        )
        return data_subject_pb2.EraseEndUserResponse(
            receipt=encode_receipt(erasure.receipt), session_key_prefixes=list(erasure.key_prefixes)
        )

    async def ExportEndUser(
        self, request: data_subject_pb2.ExportEndUserRequest, context: _Context
    ) -> AsyncIterator[data_subject_pb2.ExportEndUserResponse]:
        namespace = _namespace(request.namespace)
        items = self._requests.export(
            namespace,
            request.user_id,
            actor=current_call().caller.spiffe_id,
            resume_token=request.resume_token,
            extra_agents=_agents(request.agents, namespace),
        )
        async for item in items:
            yield _export_message(item)

    async def GetErasureReceipt(
        self, request: data_subject_pb2.GetErasureReceiptRequest, context: _Context
    ) -> data_subject_pb2.GetErasureReceiptResponse:
        receipt_id = decode_uuid(request.id, "id", "a receipt id")
        return data_subject_pb2.GetErasureReceiptResponse(
            receipt=encode_receipt(await self._requests.receipt(receipt_id))
        )
