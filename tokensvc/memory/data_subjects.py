"""End-user data rights (issue 17): erase or export one end-user's memories across every agent of
a namespace (or of every namespace), with a receipt.

tokensvc stores no end-user id: a user's memories live in a bucket that is an HMAC of
(namespace, agent, user) under a versioned pepper. So a request computes the user's bucket for
every agent that has a memory space, under every pepper version still in the keyring, and works
through those buckets (in bounded batches, each its own short transaction, so other tenants'
searches are never held up). The raw user id is used for that computation only, in memory: it is
never logged, stored, traced or echoed, and a receipt records what was done, not whose.

Both answers also list the user's session-memory key prefixes (`mem:{namespace}/{agent}:{bucket}:`
for every agent and pepper version), so the state layer's operator can purge the conversation
history too. Agents are known from their memory spaces: an agent that never remembered anything
long-term has none, and its session keys are not listed.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import datetime

from opentelemetry import trace

from tokensvc.audit import AuditKind, AuditLog, AuditOutcome
from tokensvc.auth.buckets import PepperKeyring, all_bucket_ids
from tokensvc.errors import InvalidArgument, NotFound
from tokensvc.storage.ports import DataSubjectStore
from tokensvc.storage.records import AgentMemories, DataSubjectReceipt, ExportedMemory, ReceiptKind, Tenant

__all__ = [
    "AgentMemories",
    "DataSubjectReceipt",
    "DataSubjectRequests",
    "Erasure",
    "ExportItem",
    "ExportedMemory",
    "ReceiptKind",
]

_tracer = trace.get_tracer("tokensvc.memory.data_subjects")
_AGENT_PAGE = 500
MAX_USER_ID_BYTES = 1024


@dataclass(frozen=True)
class Erasure:
    receipt: DataSubjectReceipt
    key_prefixes: tuple[str, ...]


@dataclass(frozen=True)
class ExportItem:
    """One message of an export: a memory (with the token that resumes after it), a session-memory
    key prefix, or, last, the receipt."""

    memory: ExportedMemory | None = None
    resume_token: str = ""
    key_prefix: str | None = None
    receipt: DataSubjectReceipt | None = None


def session_key_prefix(namespace: str, agent: str, bucket: str) -> str:
    """The per-user session-memory key prefix (context/session-memory.md's layout)."""
    return f"mem:{namespace}/{agent}:{bucket}:"


class DataSubjectRequests:
    """EraseEndUser, ExportEndUser and GetErasureReceipt: each one domain call of its RPC."""

    def __init__(
        self,
        store: DataSubjectStore,
        keyring: Callable[[], PepperKeyring],
        audit: AuditLog,
        *,
        batch_size: int = 1000,
    ):
        self._store = store
        self._keyring = keyring
        self._audit = audit
        self._batch = batch_size

    async def _spaces(self, namespace: str) -> AsyncIterator[tuple[str, str]]:
        after: tuple[str, str] | None = None
        while True:
            page = await self._store.agents(namespace or None, after=after, limit=_AGENT_PAGE)
            for space in page:
                yield space
            if len(page) < _AGENT_PAGE:
                return
            after = page[-1]

    def _tenant(self, namespace: str, agent: str, user_id: str) -> Tenant:
        """The user's buckets in this agent's space, under every pepper version in the keyring."""
        return Tenant(namespace, agent, tuple(all_bucket_ids(self._keyring(), namespace, agent, user_id)))

    async def erase(self, namespace: str, user_id: str, *, actor: str) -> Erasure:
        """Delete the user's memories in every agent's space; idempotent (a second erasure finds
        nothing and says so in a receipt of its own)."""
        _check_user(user_id)
        with _tracer.start_as_current_span("data_subject.erase") as span:
            span.set_attribute("tokensvc.namespace", namespace)
            per_agent: list[AgentMemories] = []
            prefixes: list[str] = []
            agents = 0
            async for space_ns, agent in self._spaces(namespace):
                agents += 1
                tenant = self._tenant(space_ns, agent, user_id)
                prefixes += [session_key_prefix(space_ns, agent, b) for b in tenant.buckets]
                erased = 0
                while True:
                    began = time.monotonic()
                    batch = await self._store.erase(tenant, limit=self._batch)
                    if not batch:
                        break
                    erased += batch
                    # A batch per transaction, then as long a pause: the database spends at most
                    # half its time on the erasure, and other tenants' statements run between.
                    await asyncio.sleep(time.monotonic() - began)
                if erased:
                    per_agent.append(AgentMemories(space_ns, agent, erased))
            receipt = await self._receipt(ReceiptKind.ERASURE, namespace, per_agent, agents, prefixes, actor)
            span.set_attribute("tokensvc.result_count", receipt.memories)
            return Erasure(receipt, tuple(prefixes))

    async def export(
        self, namespace: str, user_id: str, *, actor: str, resume_token: str = ""
    ) -> AsyncIterator[ExportItem]:
        """Every live memory of the user, agent by agent in (namespace, agent) order and within
        one in (bucket, created_at, id) order; then the session-memory key prefixes; then the
        receipt. `resume_token` (a memory's) resumes after that memory."""
        _check_user(user_id)
        resume = _decode_resume(resume_token)
        per_agent: list[AgentMemories] = []
        prefixes: list[str] = []
        agents = 0
        async for space_ns, agent in self._spaces(namespace):
            agents += 1
            tenant = self._tenant(space_ns, agent, user_id)
            prefixes += [session_key_prefix(space_ns, agent, b) for b in tenant.buckets]
            after: tuple[str, datetime, str] | None = None
            if resume is not None:
                if (space_ns, agent) < resume[0]:
                    continue
                if (space_ns, agent) == resume[0]:
                    after = resume[1]
            exported = 0
            while page := await self._store.export(tenant, after=after, limit=self._batch):
                for item in page:
                    exported += 1
                    yield ExportItem(memory=item, resume_token=_encode_resume(item))
                last = page[-1]
                after = (last.bucket, last.memory.created_at, last.memory.id)
            if exported:
                per_agent.append(AgentMemories(space_ns, agent, exported))
        for prefix in prefixes:
            yield ExportItem(key_prefix=prefix)
        receipt = await self._receipt(ReceiptKind.EXPORT, namespace, per_agent, agents, prefixes, actor)
        yield ExportItem(receipt=receipt)

    async def receipt(self, receipt_id: str) -> DataSubjectReceipt:
        found = await self._store.receipt(receipt_id)
        if found is None:
            raise NotFound("no such receipt")
        return found

    async def _receipt(
        self,
        kind: ReceiptKind,
        namespace: str,
        per_agent: list[AgentMemories],
        agents: int,
        prefixes: list[str],
        actor: str,
    ) -> DataSubjectReceipt:
        receipt = await self._store.record_receipt(
            DataSubjectReceipt(
                id=str(uuid.uuid4()),
                kind=kind,
                namespace=namespace,
                memories=sum(a.memories for a in per_agent),
                per_agent=tuple(per_agent),
                agents=agents,
                key_prefixes=len(prefixes),
                actor=actor,
            )
        )
        verb = "erased" if kind is ReceiptKind.ERASURE else "exported"
        await self._audit.record(
            AuditKind.DATA_SUBJECT_REQUEST,
            actor=actor,
            action=f"{kind.value} of an end-user's memories",
            target=f"receipt:{receipt.id} namespace:{namespace or '*'}",
            outcome=AuditOutcome.SUCCEEDED,
            detail=f"{verb} {receipt.memories} memories in {len(per_agent)} of {agents} agents",
        )
        return receipt


def _check_user(user_id: str) -> None:
    if not user_id or not user_id.strip():
        raise InvalidArgument("user_id", "must not be empty")
    if len(user_id.encode("utf-8", "surrogatepass")) > MAX_USER_ID_BYTES:
        raise InvalidArgument("user_id", f"must be at most {MAX_USER_ID_BYTES} bytes")


def _encode_resume(item: ExportedMemory) -> str:
    """Where an export resumes after `item`: its space and its place in it (no user id: the bucket
    is an HMAC, and the token only ever resumes the same user's export)."""
    raw = json.dumps(
        [item.namespace, item.agent, item.bucket, item.memory.created_at.isoformat(), item.memory.id],
        separators=(",", ":"),
    )
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def _decode_resume(token: str) -> tuple[tuple[str, str], tuple[str, datetime, str]] | None:
    if not token:
        return None
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        namespace, agent, bucket, created, memory_id = json.loads(raw)
        moment = datetime.fromisoformat(created)
        if (
            not all(isinstance(v, str) for v in (namespace, agent, bucket, memory_id))
            or moment.tzinfo is None
        ):
            raise ValueError("malformed")
        Tenant(namespace, agent, (bucket,))  # validates the names and the bucket
        return (namespace, agent), (bucket, moment, str(uuid.UUID(memory_id)))
    except (ValueError, TypeError, binascii.Error, json.JSONDecodeError):
        raise InvalidArgument("resume_token", "is not a token this export returned") from None
