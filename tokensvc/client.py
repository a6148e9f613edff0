"""An async Python client for tokensvc, the one a launcher imports (and the CLI uses).

    async with TokensvcClient("tokensvc:50051", ca_file=..., cert_file=..., key_file=...,
                              capability=lambda: Path("/run/capability").read_text()) as client:
        scope = await client.verify_capability()
        ids = await client.remember(["The user prefers metric units"])
        hits = await client.search_memories("which units?", top_k=5)

- mTLS from certificate files; when the files change (a rotated workload certificate) the next
  call builds a new channel, and the old one is closed once its calls have finished.
- The capability (a string, or a function returning the current one) travels as
  `authorization: Bearer <token>` on every launcher call.
- Every call has a deadline. Idempotent calls are retried on UNAVAILABLE with jittered
  exponential backoff; writes are not (a Remember whose items all carry idempotency keys is).
- Errors are `CallFailed` with the status code and the stable `ErrorInfo` reason. (`TokensvcError`,
  its former name here, is a deprecated alias: the name belongs to the server's domain errors,
  `tokensvc.errors.TokensvcError`.)
"""

from __future__ import annotations

import asyncio
import random
import warnings
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from tokensvc.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    capability_pb2,
    capability_pb2_grpc,
    common_pb2,
    data_subject_pb2_grpc,
    knowledge_pb2,
    knowledge_pb2_grpc,
    memory_pb2,
    memory_pb2_grpc,
    migration_pb2_grpc,
)

__all__ = ["CallFailed", "ClientCertificates", "TokensvcClient"]

_STUBS: dict[str, Callable[[grpc.aio.Channel], Any]] = {
    "CapabilityService": capability_pb2_grpc.CapabilityServiceStub,
    "MemoryService": memory_pb2_grpc.MemoryServiceStub,
    "KnowledgeService": knowledge_pb2_grpc.KnowledgeServiceStub,
    "AdminService": admin_pb2_grpc.AdminServiceStub,
    "MigrationService": migration_pb2_grpc.MigrationServiceStub,
    "DataSubjectService": data_subject_pb2_grpc.DataSubjectServiceStub,
}
# Reads and derivations: safe to send again after UNAVAILABLE.
_IDEMPOTENT = frozenset(
    {
        "VerifyCapability",
        "DeriveSessionKey",
        "SearchMemories",
        "GetMemory",
        "ListMemories",
        "GetKnowledgeBase",
        "ListKnowledgeBases",
        "GetDocument",
        "ListDocuments",
        "SearchKnowledge",
        "GetCredentialStatus",
        "ListAuditEvents",
        "ReloadTrustBundle",
        "RevokeCapability",
        "EraseEndUser",  # deleting again deletes nothing more
        "GetErasureReceipt",
    }
)


class CallFailed(Exception):
    """A failed call: gRPC status code, the stable ErrorInfo reason, its metadata and message.

    `reason` is the ErrorInfo reason as sent (a string: a newer server may send one this client
    does not know), or None when the failure carried none (an unreachable server, say).
    """

    def __init__(self, code: grpc.StatusCode, message: str, reason: str | None, metadata: dict[str, str]):
        super().__init__(f"{code.name}{f' ({reason})' if reason else ''}: {message}")
        self.code = code
        self.message = message
        self.reason = reason
        self.metadata = metadata

    @property
    def field(self) -> str | None:
        return self.metadata.get("field")

    @classmethod
    def from_rpc_error(cls, error: grpc.aio.AioRpcError) -> CallFailed:
        reason, metadata = None, {}
        status = rpc_status.from_call(error)  # type: ignore[arg-type]
        if status is not None:
            for detail in status.details:
                if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                    info = error_details_pb2.ErrorInfo()
                    detail.Unpack(info)
                    reason, metadata = info.reason, dict(info.metadata)
        return cls(error.code(), error.details() or "", reason, metadata)


if not TYPE_CHECKING:  # type checkers see no such name, so new code is told to use CallFailed

    def __getattr__(name: str) -> Any:
        if name == "TokensvcError":
            warnings.warn(
                "tokensvc.client.TokensvcError is deprecated; catch tokensvc.client.CallFailed",
                DeprecationWarning,
                stacklevel=2,
            )
            return CallFailed
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class ClientCertificates:
    ca_file: Path
    cert_file: Path
    key_file: Path

    def stamp(self) -> tuple[int, ...]:
        parts: list[int] = []
        for path in (self.ca_file, self.cert_file, self.key_file):
            stat = path.stat()
            parts += [stat.st_ino, stat.st_mtime_ns, stat.st_size]
        return tuple(parts)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_file.read_bytes(),
            private_key=self.key_file.read_bytes(),
            certificate_chain=self.cert_file.read_bytes(),
        )


@dataclass
class TokensvcClient:
    target: str
    ca_file: Path | str
    cert_file: Path | str
    key_file: Path | str
    capability: str | Callable[[], str] | None = None
    timeout: float = 10.0
    max_attempts: int = 4
    backoff: float = 0.1
    max_backoff: float = 2.0
    check_interval: float = 1.0
    _certs: ClientCertificates = field(init=False)
    _channel: grpc.aio.Channel | None = field(default=None, init=False)
    _stamp: tuple[int, ...] = field(default=(), init=False)
    _next_check: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        self._certs = ClientCertificates(Path(self.ca_file), Path(self.cert_file), Path(self.key_file))

    async def __aenter__(self) -> TokensvcClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close(None)
            self._channel = None

    def _current_channel(self) -> grpc.aio.Channel:
        """The channel for the certificate files as they are now; rebuilt when they change."""
        loop_time = asyncio.get_running_loop().time()
        if self._channel is not None and loop_time < self._next_check:
            return self._channel
        self._next_check = loop_time + self.check_interval
        stamp = self._certs.stamp()
        if self._channel is None or stamp != self._stamp:
            old = self._channel
            self._channel = grpc.aio.secure_channel(self.target, self._certs.credentials())
            self._stamp = stamp
            if old is not None:
                # Let calls still running on the old channel finish before closing it.
                asyncio.get_running_loop().create_task(old.close(grace=self.timeout))
        return self._channel

    def _metadata(self, with_capability: bool) -> tuple[tuple[str, str], ...]:
        if not with_capability or self.capability is None:
            return ()
        token = self.capability() if callable(self.capability) else self.capability
        return (("authorization", f"Bearer {token.strip()}"),)

    async def call(
        self,
        service: str,
        method: str,
        request: Any,
        *,
        capability: bool = False,
        idempotent: bool | None = None,
        deadline_seconds: float | None = None,
    ) -> Any:
        """One unary call with deadline, capability and retries; raises CallFailed."""
        retry = method in _IDEMPOTENT if idempotent is None else idempotent
        attempts = self.max_attempts if retry else 1
        delay = self.backoff
        for attempt in range(1, attempts + 1):
            stub = _STUBS[service](self._current_channel())
            try:
                return await getattr(stub, method)(
                    request, timeout=deadline_seconds or self.timeout, metadata=self._metadata(capability)
                )
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE or attempt == attempts:
                    raise CallFailed.from_rpc_error(error) from None
            await asyncio.sleep(random.uniform(delay / 2, delay))  # noqa: S311 - jitter, not crypto
            delay = min(delay * 2, self.max_backoff)
        raise AssertionError("unreachable")

    async def stream(
        self, service: str, method: str, request: Any, *, deadline_seconds: float | None = None
    ) -> AsyncIterator[Any]:
        """The messages of one server-streaming call (no retries: a stream resumes by its own
        tokens); raises CallFailed."""
        stub = _STUBS[service](self._current_channel())
        call = getattr(stub, method)(
            request, timeout=deadline_seconds or self.timeout, metadata=self._metadata(False)
        )
        try:
            async for message in call:
                yield message
        except grpc.aio.AioRpcError as error:
            raise CallFailed.from_rpc_error(error) from None

    async def upload_document(
        self,
        header: knowledge_pb2.UploadDocumentHeader,
        pieces: Iterable[bytes],
        *,
        deadline_seconds: float = 600,
    ) -> knowledge_pb2.UploadDocumentResponse:
        """Stream a document (control plane): the header, then the content pieces."""

        async def requests() -> Any:
            yield knowledge_pb2.UploadDocumentRequest(header=header)
            for piece in pieces:
                yield knowledge_pb2.UploadDocumentRequest(content=piece)

        stub = knowledge_pb2_grpc.KnowledgeServiceStub(self._current_channel())
        try:
            response: knowledge_pb2.UploadDocumentResponse = await stub.UploadDocument(
                requests(), timeout=deadline_seconds
            )
        except grpc.aio.AioRpcError as error:
            raise CallFailed.from_rpc_error(error) from None
        return response

    # --- launcher conveniences ---------------------------------------------------------------

    async def verify_capability(self) -> capability_pb2.CapabilityScope:
        response = await self.call(
            "CapabilityService", "VerifyCapability", capability_pb2.VerifyCapabilityRequest(), capability=True
        )
        scope: capability_pb2.CapabilityScope = response.scope
        return scope

    async def derive_session_key(
        self, conversation_id: str, *, shared: bool = False
    ) -> capability_pb2.DeriveSessionKeyResponse:
        scope = capability_pb2.SESSION_SCOPE_SHARED if shared else capability_pb2.SESSION_SCOPE_SESSION
        request = capability_pb2.DeriveSessionKeyRequest(conversation_id=conversation_id, scope=scope)
        response: capability_pb2.DeriveSessionKeyResponse = await self.call(
            "CapabilityService", "DeriveSessionKey", request, capability=True
        )
        return response

    async def remember(
        self, items: Sequence[str | memory_pb2.RememberItem]
    ) -> list[memory_pb2.RememberResult]:
        messages = [memory_pb2.RememberItem(content=i) if isinstance(i, str) else i for i in items]
        # Retrying is safe only when every item carries an idempotency key.
        idempotent = all(item.idempotency_key for item in messages)
        response = await self.call(
            "MemoryService",
            "Remember",
            memory_pb2.RememberRequest(items=messages),
            capability=True,
            idempotent=idempotent,
        )
        return list(response.results)

    async def search_memories(
        self,
        query: str,
        *,
        top_k: int = 10,
        mode: common_pb2.SearchMode.ValueType = common_pb2.SEARCH_MODE_UNSPECIFIED,
        filter: common_pb2.Filter | None = None,
        min_score: float | None = None,
    ) -> list[memory_pb2.MemorySearchResult]:
        """The best memories for `query`; `mode` unset is the server's default (HYBRID)."""
        request = memory_pb2.SearchMemoriesRequest(query_text=query, top_k=top_k, mode=mode)
        if filter is not None:
            request.filter.CopyFrom(filter)
        if min_score is not None:
            request.min_score = min_score
        response = await self.call("MemoryService", "SearchMemories", request, capability=True)
        return list(response.results)

    async def search_knowledge(
        self,
        query: str,
        *,
        knowledge_bases: Sequence[str] = (),
        top_k: int = 5,
        mode: common_pb2.SearchMode.ValueType = common_pb2.SEARCH_MODE_UNSPECIFIED,
    ) -> list[knowledge_pb2.Passage]:
        """Cited passages for `query`; `mode` unset is the server's default (HYBRID)."""
        request = knowledge_pb2.SearchKnowledgeRequest(
            knowledge_base_refs=list(knowledge_bases), query_text=query, top_k=top_k, mode=mode
        )
        response = await self.call("KnowledgeService", "SearchKnowledge", request, capability=True)
        return list(response.passages)

    async def credential_status(self) -> admin_pb2.CredentialStatus:
        response = await self.call(
            "AdminService", "GetCredentialStatus", admin_pb2.GetCredentialStatusRequest()
        )
        status: admin_pb2.CredentialStatus = response.status
        return status
