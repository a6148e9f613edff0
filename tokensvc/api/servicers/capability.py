"""CapabilityService: thin decode -> one domain call -> encode."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import duration_pb2

from tokensvc.api.context import current_call
from tokensvc.api.convert import (
    current_scope,
    duration_seconds,
    scope_to_proto,
    session_scope_from_proto,
    session_scope_to_proto,
    timestamp,
)
from tokensvc.auth.issuer import IssueRequest
from tokensvc.auth.operations import CapabilityOperations
from tokensvc.auth.session_keys import (
    MAX_HISTORY_MESSAGES,
    MAX_RETAINED_ENTRIES,
    SESSION_TTL_SECONDS,
    TTL_REFRESHED_ON_WRITE,
)
from tokensvc.errors import InvalidArgument
from tokensvc.v1 import capability_pb2, capability_pb2_grpc

__all__ = ["CapabilityServicer"]

_Context = grpc.aio.ServicerContext[Any, Any]


class CapabilityServicer(capability_pb2_grpc.CapabilityServiceServicer):
    def __init__(self, operations: CapabilityOperations):
        self._operations = operations

    async def VerifyCapability(
        self, request: capability_pb2.VerifyCapabilityRequest, context: _Context
    ) -> capability_pb2.VerifyCapabilityResponse:
        return capability_pb2.VerifyCapabilityResponse(scope=scope_to_proto(current_scope()))

    async def DeriveSessionKey(
        self, request: capability_pb2.DeriveSessionKeyRequest, context: _Context
    ) -> capability_pb2.DeriveSessionKeyResponse:
        derived, previous_keys = self._operations.session_key(
            current_scope(), request.conversation_id, session_scope_from_proto(request.scope)
        )
        return capability_pb2.DeriveSessionKeyResponse(
            key=derived.key,
            effective_scope=session_scope_to_proto(derived.effective_scope),
            downgraded=derived.downgraded,
            per_user=derived.per_user,
            max_history_messages=MAX_HISTORY_MESSAGES,
            max_retained_entries=MAX_RETAINED_ENTRIES,
            ttl=duration_pb2.Duration(seconds=SESSION_TTL_SECONDS),
            ttl_refreshed_on_write=TTL_REFRESHED_ON_WRITE,
            previous_keys=previous_keys,
        )

    async def IssueCapability(
        self, request: capability_pb2.IssueCapabilityRequest, context: _Context
    ) -> capability_pb2.IssueCapabilityResponse:
        issued = self._operations.issue(
            IssueRequest(
                namespace=request.namespace,
                agent=request.agent,
                user=request.user if request.HasField("user") else None,
                per_user=request.per_user,
                registry=request.registry or None,
                long_term_memory=request.long_term_memory,
                knowledge_bases=list(request.knowledge_bases),
                run_id=request.run_id or None,
                ttl_seconds=duration_seconds(request.ttl, "ttl") if request.HasField("ttl") else None,
                cnf_x5t_s256=request.cnf_x5t_s256 or None,
            )
        )
        return capability_pb2.IssueCapabilityResponse(
            token=issued.token,
            jti=issued.jti,
            run_id=issued.run_id,
            expires_at=timestamp(issued.expires_at),
        )

    async def RevokeCapability(
        self, request: capability_pb2.RevokeCapabilityRequest, context: _Context
    ) -> capability_pb2.RevokeCapabilityResponse:
        target = request.WhichOneof("target")
        if target is None:
            raise InvalidArgument("target", "set jti or run_id")
        revoked_at = await self._operations.revoke(
            "jti" if target == "jti" else "run",
            getattr(request, target),
            reason=request.reason,
            revoked_by=current_call().caller.spiffe_id,
        )
        return capability_pb2.RevokeCapabilityResponse(revoked_at=timestamp(revoked_at))
