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
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from opentelemetry import trace

from tokensvc.audit import AuditKind, AuditLog, AuditOutcome
from tokensvc.auth.buckets import PepperKeyring, all_bucket_ids, parse_bucket_version
from tokensvc.auth.capabilities import MAX_USER_CHARS
from tokensvc.errors import InvalidArgument, NotFound
from tokensvc.storage.ports import DataSubjectStore
from tokensvc.storage.records import AgentMemories, DataSubjectReceipt, ExportedMemory, ReceiptKind, Tenant
from tokensvc.untrusted_json import parse_base64url

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
_EARLIEST = datetime(1970, 1, 1, tzinfo=UTC)
_LATEST = datetime(9000, 1, 1, tzinfo=UTC)
# A resume token holds two DNS labels, a bucket id, a time and a UUID: about 360 characters.
_MAX_RESUME_TOKEN = 1024


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

    async def _spaces(self, namespace: str, extra_agents: Sequence[str]) -> list[tuple[str, str]]:
        """The memory spaces of the namespace (or of every one), and `extra_agents` of it (agents
        with session memory only have no space), in code-point order: the order an export's
        resume token is compared in, whatever the database's collation."""
        spaces: set[tuple[str, str]] = {(namespace, agent) for agent in extra_agents}
        after: tuple[str, str] | None = None
        while True:
            page = await self._store.agents(namespace or None, after=after, limit=_AGENT_PAGE)
            spaces.update(page)
            if len(page) < _AGENT_PAGE:
                return sorted(spaces)
            after = page[-1]

    def _tenant(self, namespace: str, agent: str, user_id: str) -> Tenant:
        """The user's buckets in this agent's space, under every pepper version in the keyring."""
        return Tenant(namespace, agent, tuple(all_bucket_ids(self._keyring(), namespace, agent, user_id)))

    async def erase(
        self, namespace: str, user_id: str, *, actor: str, extra_agents: Sequence[str] = ()
    ) -> Erasure:
        """Delete the user's memories in every agent's space; idempotent (a second erasure finds
        nothing and says so in a receipt of its own). An erasure that fails or is cut off part of
        the way records what it erased so far (a receipt marked incomplete); run it again."""
        _check_user(user_id)
        with _tracer.start_as_current_span("data_subject.erase") as span:
            span.set_attribute("tokensvc.namespace", namespace)
            receipt_id = str(uuid.uuid4())
            await self._audit.record(
                AuditKind.DATA_SUBJECT_REQUEST,
                actor=actor,
                action="erasure of an end-user's memories",
                target=_target(receipt_id, namespace),
                outcome=AuditOutcome.STARTED,
            )
            per_agent: list[AgentMemories] = []
            prefixes: list[str] = []
            spaces = await self._spaces(namespace, extra_agents)
            try:
                for space_ns, agent in spaces:
                    tenant = self._tenant(space_ns, agent, user_id)
                    prefixes += [session_key_prefix(space_ns, agent, b) for b in tenant.buckets]
                    erased = 0
                    try:
                        while batch := await self._erase_batch(tenant):
                            erased += batch
                    finally:
                        if erased:
                            per_agent.append(AgentMemories(space_ns, agent, erased))
            except BaseException:
                # Cut off (the deadline, a cancel) or failed: what was erased is recorded all the same.
                with contextlib.suppress(Exception):
                    await self._receipt(
                        receipt_id, ReceiptKind.ERASURE, namespace, per_agent, len(spaces), prefixes, actor,
                        complete=False,
                    )  # fmt: skip
                raise
            receipt = await self._receipt(
                receipt_id, ReceiptKind.ERASURE, namespace, per_agent, len(spaces), prefixes, actor
            )
            span.set_attribute("tokensvc.result_count", receipt.memories)
            return Erasure(receipt, tuple(prefixes))

    async def _erase_batch(self, tenant: Tenant) -> int:
        """One batch in its own transaction, then as long a pause: the database spends at most
        half its time on the erasure, and other tenants' statements run between batches."""
        began = time.monotonic()
        erased = await self._store.erase(tenant, limit=self._batch)
        if erased:
            await asyncio.sleep(time.monotonic() - began)
        return erased

    async def export(
        self,
        namespace: str,
        user_id: str,
        *,
        actor: str,
        resume_token: str = "",
        extra_agents: Sequence[str] = (),
    ) -> AsyncIterator[ExportItem]:
        """Every live memory of the user, agent by agent in (namespace, agent) order and within
        one in (bucket, created_at, id) order; then the session-memory key prefixes; then the
        receipt. `resume_token` (a memory's) resumes after that memory."""
        _check_user(user_id)
        resume = _decode_resume(resume_token)
        per_agent: list[AgentMemories] = []
        prefixes: list[str] = []
        spaces = await self._spaces(namespace, extra_agents)
        for space_ns, agent in spaces:
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
        receipt = await self._receipt(
            str(uuid.uuid4()), ReceiptKind.EXPORT, namespace, per_agent, len(spaces), prefixes, actor
        )
        yield ExportItem(receipt=receipt)

    async def receipt(self, receipt_id: str) -> DataSubjectReceipt:
        found = await self._store.receipt(receipt_id)
        if found is None:
            raise NotFound("no such receipt")
        return found

    async def _receipt(
        self,
        receipt_id: str,
        kind: ReceiptKind,
        namespace: str,
        per_agent: list[AgentMemories],
        agents: int,
        prefixes: list[str],
        actor: str,
        *,
        complete: bool = True,
    ) -> DataSubjectReceipt:
        receipt = await self._store.record_receipt(
            DataSubjectReceipt(
                id=receipt_id,
                kind=kind,
                namespace=namespace,
                memories=sum(a.memories for a in per_agent),
                per_agent=tuple(per_agent),
                agents=agents,
                key_prefixes=len(prefixes),
                actor=actor,
                complete=complete,
            )
        )
        verb = "erased" if kind is ReceiptKind.ERASURE else "exported"
        await self._audit.record(
            AuditKind.DATA_SUBJECT_REQUEST,
            actor=actor,
            action=f"{kind.value} of an end-user's memories",
            target=_target(receipt.id, namespace),
            outcome=AuditOutcome.SUCCEEDED if complete else AuditOutcome.FAILED,
            detail=f"{verb} {receipt.memories} memories in {len(per_agent)} of {agents} agents"
            + ("" if complete else " before it was cut off; run it again"),
        )
        return receipt


def _target(receipt_id: str, namespace: str) -> str:
    return f"receipt:{receipt_id} namespace:{namespace or '*'}"


def _check_user(user_id: str) -> None:
    """Every user a capability can name (its `user` claim: 1..512 characters, no U+0000, no lone
    surrogate), and nothing else."""
    if not 0 < len(user_id) <= MAX_USER_CHARS:
        raise InvalidArgument("user_id", f"must be 1 to {MAX_USER_CHARS} characters, as a capability's user")
    if "\x00" in user_id:
        raise InvalidArgument("user_id", "must not contain U+0000 (NUL)")
    try:
        user_id.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument("user_id", "must be valid UTF-8") from None


def _encode_resume(item: ExportedMemory) -> str:
    """Where an export resumes after `item`: its space and its place in it (no user id: the bucket
    is an HMAC, and the token only ever resumes the same user's export)."""
    raw = json.dumps(
        [item.namespace, item.agent, item.bucket, item.memory.created_at.isoformat(), item.memory.id],
        separators=(",", ":"),
    )
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def _decode_resume(token: str) -> tuple[tuple[str, str], tuple[str, datetime, str]] | None:
    """The position `_encode_resume` wrote; anything else is INVALID_ARGUMENT: bounded in size
    and nesting before it is parsed, and every element in the format the export writes it in."""
    if not token:
        return None
    try:
        namespace, agent, bucket, created, memory_id = parse_base64url(token, max_chars=_MAX_RESUME_TOKEN)
        moment = datetime.fromisoformat(created)
        if (
            not all(isinstance(v, str) for v in (namespace, agent, bucket, memory_id))
            or moment.tzinfo is None
        ):
            raise ValueError("malformed")
        # A memory's time, so within what PostgreSQL and asyncpg convert (0001 or 9999 with an
        # offset would overflow on the way).
        if not _EARLIEST <= moment.astimezone(UTC) <= _LATEST:
            raise ValueError("out of range")
        Tenant(namespace, agent, (bucket,))  # validates the names
        parse_bucket_version(bucket)  # an HMAC bucket id, as the export's own buckets are
        return (namespace, agent), (bucket, moment, str(uuid.UUID(memory_id)))
    except (ValueError, TypeError, OverflowError):  # UntrustedJsonError is a ValueError
        raise InvalidArgument("resume_token", "is not a token this export returned") from None
