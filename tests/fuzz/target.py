"""The live target of the fuzz tests: one tokensvc over mTLS, its tenants, and how a call is judged.

The fuzzed tenant is a namespace of its own (every namespace starting with `FUZZ_NS` belongs to
the fuzzer). Three things must survive every fuzz test untouched:

- the sentinel tenant: another namespace with the same agent name, user id and knowledge-base
  refs, filled first and compared row by row;
- the canaries inside the fuzzed namespace: the memories of another end-user of the fuzzed agent
  (`CANARY_USER`, a bucket of its own) and a knowledge base no fuzzed request names
  (`CANARY_KB`, with a document);
- every row of every other namespace (digests), the credential journal and the app password.

`send` makes one call and asserts what every answer must be: OK or a deliberate status with a
stable reason (an INVALID_ARGUMENT names its field), never INTERNAL or UNKNOWN, never a hang,
and the server's own record of the call (tokensvc_rpcs_total) agrees.
"""

from __future__ import annotations

import asyncio
import collections
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support import RpcFailure, SharedDatabase, bearer, dev_capability, failure_of, superuser
from tokensvc.app import Service
from tokensvc.credentials import FileCredentialSource
from tokensvc.observability import METRICS
from tokensvc.v1 import (
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

TIMEOUT = 30.0
RUN = uuid.uuid4().hex[:8]
FUZZ_NS = f"fuzz-{RUN}"
SPARE_NS = f"fuzz-{RUN}-spare"  # valid, owned by the fuzzer, empty
SENTINEL_NS = f"sentinel-{RUN}"
AGENT = "agent-fuzz"
USER = "fuzz-user@example.com"
CANARY_USER = "canary-user@example.com"  # another end-user of the fuzzed agent: never fuzzed
KB_A, KB_B = "kb-fuzz-a", "kb-fuzz-b"
CANARY_KB = "kb-canary-keep"  # in the fuzzed namespace; no fuzzed request names it
DIMENSION = 384  # the default `hash` embedder's
MAX_UPLOAD = 256 * 1024
# Statuses tokensvc answers deliberately, each with an ErrorInfo reason.
DELIBERATE = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
STUBS = {
    "CapabilityService": capability_pb2_grpc.CapabilityServiceStub,
    "MemoryService": memory_pb2_grpc.MemoryServiceStub,
    "KnowledgeService": knowledge_pb2_grpc.KnowledgeServiceStub,
    "AdminService": admin_pb2_grpc.AdminServiceStub,
    "MigrationService": migration_pb2_grpc.MigrationServiceStub,
    "DataSubjectService": data_subject_pb2_grpc.DataSubjectServiceStub,
}


@dataclass
class Known:
    """Real values to mix into generated requests, so valid requests reach deep code paths."""

    memory_ids: list[str] = field(default_factory=list)
    memory_page_token: str = ""
    kb_page_token: str = ""
    doc_page_token: str = ""
    audit_page_token: str = ""
    doc_refs: list[str] = field(default_factory=lambda: ["handbook.md", "notes.txt", "page.html"])


@dataclass
class Target:
    service: Service
    database: SharedDatabase
    channels: dict[str, grpc.aio.Channel]  # launcher, sentinel, canary, control-plane, admin
    token: str  # the fuzzed launcher's capability
    known: Known
    canary_bucket: str = ""
    baseline: dict[str, Any] = field(default_factory=dict)
    # Calls of each method the server has recorded (tokensvc_rpcs_total) after the last call.
    recorded: dict[str, int] = field(default_factory=dict)
    # Upload refusals the asyncio client misreported as INTERNAL, by the code the server sent.
    artifacts: collections.Counter[str] = field(default_factory=collections.Counter)

    def stub(self, service_name: str, role: str) -> Any:
        return STUBS[service_name](self.channels[role])


# --- what must not change -------------------------------------------------------------------------

_OWNED = "namespace LIKE $1"  # the fuzzer's namespaces: FUZZ_NS and every name it starts


def _owned_pattern() -> str:
    return FUZZ_NS + "%"  # RUN is hex: no LIKE wildcard in it


async def table_digests(conn: asyncpg.Connection) -> dict[str, tuple[int, str]]:
    """(row count, md5 of every row in key order) of each tenant table, outside the fuzzer's namespaces."""
    tables = {
        "memories": "bucket, id",
        "memory_spaces": "namespace, agent",
        "knowledge_bases": "namespace, ref",
        "documents": "namespace, kb_ref, ref, version",
        "chunks": "namespace, kb_ref, doc_ref, version, chunk_index",
    }
    digests = {}
    for table, order in tables.items():
        row = await conn.fetchrow(
            f"SELECT count(*) AS n, coalesce(md5(string_agg(t::text, E'\\n' ORDER BY {order})), '') AS h "  # noqa: S608
            f"FROM tokensvc.{table} t WHERE NOT ({_OWNED})",
            _owned_pattern(),
        )
        assert row is not None
        digests[table] = (int(row["n"]), str(row["h"]))
    return digests


_TENANT_ROWS = (
    "SELECT bucket, id::text, content, metadata::text, embedding::text, created_at, updated_at, expires_at "
    "FROM tokensvc.memories WHERE namespace = $1 AND {memories} ORDER BY bucket, id",
    "SELECT ref, display_name, embedder, created_at FROM tokensvc.knowledge_bases "
    "WHERE namespace = $1 AND {bases} ORDER BY ref",
    "SELECT kb_ref, ref, version, content_sha256 FROM tokensvc.documents "
    "WHERE namespace = $1 AND {documents} ORDER BY kb_ref, ref, version",
    "SELECT kb_ref, doc_ref, version, chunk_index, text FROM tokensvc.chunks "
    "WHERE namespace = $1 AND {documents} ORDER BY kb_ref, doc_ref, version, chunk_index",
)


async def sentinel_rows(conn: asyncpg.Connection) -> list[tuple[Any, ...]]:
    """The sentinel tenant's rows, in full, for an exact before/after comparison."""
    rows: list[tuple[Any, ...]] = []
    for query in _TENANT_ROWS:
        sql = query.format(memories="true", bases="true", documents="true")
        rows += [tuple(row) for row in await conn.fetch(sql, SENTINEL_NS)]
    return rows


async def canary_rows(conn: asyncpg.Connection, bucket: str) -> list[tuple[Any, ...]]:
    """The canaries of the fuzzed namespace, in full: the canary bucket's memories and `CANARY_KB`."""
    memories, *knowledge = _TENANT_ROWS
    sql = memories.format(memories="bucket = $2")
    rows = [tuple(row) for row in await conn.fetch(sql, FUZZ_NS, bucket)]
    for query in knowledge:
        sql = query.format(bases="ref = $2", documents="kb_ref = $2")
        rows += [tuple(row) for row in await conn.fetch(sql, FUZZ_NS, CANARY_KB)]
    return rows


async def malformed_names(conn: asyncpg.Connection) -> list[tuple[str, str]]:
    """Namespaces and knowledge-base refs the fuzzer managed to store that are not valid names
    (a trailing newline accepted by a `$`-anchored pattern, say). PostgreSQL's `$` is the end."""
    label = "^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
    kb_ref = "^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"
    rows = await conn.fetch(
        "SELECT 'namespace' AS kind, namespace AS name FROM tokensvc.knowledge_bases "
        "WHERE namespace LIKE $1 AND namespace !~ $2 "
        "UNION ALL SELECT 'kb_ref', ref FROM tokensvc.knowledge_bases WHERE namespace LIKE $1 AND ref !~ $3 "
        "UNION ALL SELECT 'memory namespace', namespace FROM tokensvc.memories "
        "WHERE namespace LIKE $1 AND namespace !~ $2",
        _owned_pattern(),
        label,
        kb_ref,
    )
    return [(row["kind"], row["name"]) for row in rows]


async def state_of(target: Target) -> dict[str, Any]:
    database = target.database
    async with superuser(database) as conn:
        return {
            "tables": await table_digests(conn),
            "sentinel": await sentinel_rows(conn),
            "canary": await canary_rows(conn, target.canary_bucket),
            "malformed_names": await malformed_names(conn),
            "rotations": await conn.fetchval("SELECT count(*) FROM tokensvc.credential_rotations"),
            "app_password": FileCredentialSource(database.app_credential_dir).read().password,
        }


async def assert_intact(target: Target) -> None:
    """The server is SERVING and nothing the fuzzer must not touch has changed."""
    assert await health_status(target.channels["admin"]) == health_pb2.HealthCheckResponse.SERVING
    assert await health_status(target.channels["launcher"]) == health_pb2.HealthCheckResponse.SERVING
    after = await state_of(target)
    before = target.baseline
    assert after["malformed_names"] == [], "a fuzzed request stored a malformed name"
    assert after["sentinel"] == before["sentinel"], "the sentinel tenant changed"
    assert after["canary"] == before["canary"], "the canary bucket or knowledge base changed"
    assert after["tables"] == before["tables"], "rows outside the fuzzer's namespaces changed"
    assert after["rotations"] == before["rotations"]
    assert after["app_password"] == before["app_password"]


async def health_status(channel: grpc.aio.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    response = await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
    return int(response.status)


# --- seeding ----------------------------------------------------------------------------------


def launcher_token(dev: Any, namespace: str, *, kbs: Sequence[str], user: str = USER) -> str:
    return dev_capability(
        dev,
        namespace=namespace,
        agent=AGENT,
        user=user,
        per_user=True,
        long_term_memory=True,
        knowledge_bases=list(kbs),
    )


def upload(namespace: str, kb: str, doc: str, text: str, content_type: str) -> list[Any]:
    header = knowledge_pb2.UploadDocumentHeader(
        namespace=namespace,
        knowledge_base_ref=kb,
        document_ref=doc,
        content_type=content_type,
        wait_until_ready=True,
    )
    return [
        knowledge_pb2.UploadDocumentRequest(header=header),
        knowledge_pb2.UploadDocumentRequest(content=text.encode()),
    ]


async def remember(target: Target, launcher: str, token: str, tag: str) -> memory_pb2.RememberResponse:
    memory = memory_pb2_grpc.MemoryServiceStub(target.channels[launcher])
    items = [
        memory_pb2.RememberItem(
            content=f"{tag} fact {i} about tides and lighthouses",
            metadata={
                "n": common_pb2.MetadataValue(number_value=i),
                "topic": common_pb2.MetadataValue(string_value="sea"),
            },
        )
        for i in range(6)
    ]
    return await memory.Remember(
        memory_pb2.RememberRequest(items=items), metadata=bearer(token), timeout=TIMEOUT
    )


async def create_with_documents(target: Target, namespace: str, kb: str, tag: str) -> None:
    knowledge = knowledge_pb2_grpc.KnowledgeServiceStub(target.channels["control-plane"])
    strategy = knowledge_pb2.ChunkingStrategy(kind=knowledge_pb2.CHUNKING_KIND_MARKDOWN)
    await knowledge.CreateKnowledgeBase(
        knowledge_pb2.CreateKnowledgeBaseRequest(namespace=namespace, ref=kb, chunking=strategy),
        timeout=TIMEOUT,
    )
    for doc, text, kind in (
        (
            "handbook.md",
            f"# {tag} handbook\n\n## Tides\n\nThe {tag} tide floods twice a day.\n",
            "text/markdown",
        ),
        ("notes.txt", f"{tag} notes about lighthouses and keepers.", "text/plain"),
        ("page.html", f"<html><body><h1>{tag}</h1><p>moorings</p></body></html>", "text/html"),
    ):
        await knowledge.UploadDocument(iter(upload(namespace, kb, doc, text, kind)), timeout=TIMEOUT)


async def seed(target: Target, launcher: str, token: str, namespace: str, *, tag: str) -> None:
    """Memories and two knowledge bases with three documents each, in `namespace`."""
    response = await remember(target, launcher, token, tag)
    if launcher == "launcher":
        target.known.memory_ids += [result.id for result in response.results]
        memory = memory_pb2_grpc.MemoryServiceStub(target.channels[launcher])
        page = await memory.ListMemories(
            memory_pb2.ListMemoriesRequest(page_size=2), metadata=bearer(token), timeout=TIMEOUT
        )
        target.known.memory_page_token = page.next_page_token
    for kb in (KB_A, KB_B):
        await create_with_documents(target, namespace, kb, tag)


async def seed_canaries(target: Target, canary_token: str) -> str:
    """The canary bucket (another end-user of the fuzzed agent) and `CANARY_KB`; the bucket id."""
    await remember(target, "launcher", canary_token, "canary")
    await create_with_documents(target, FUZZ_NS, CANARY_KB, "canary")
    capability = capability_pb2_grpc.CapabilityServiceStub(target.channels["launcher"])
    verified = await capability.VerifyCapability(
        capability_pb2.VerifyCapabilityRequest(), metadata=bearer(canary_token), timeout=TIMEOUT
    )
    return verified.scope.bucket_id


# --- one call, judged ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    code: str  # the status the server sent ("OK" or a StatusCode name)
    fields: tuple[str, ...] = ()  # the BadRequest field violations the client read
    reason: str | None = None
    # The client misreported the status (grpc/grpc#36066): `code` is the server's own record,
    # and the details (fields, reason) are lost.
    misreported: bool = False


def server_codes(path: str) -> collections.Counter[str]:
    """The status codes the server recorded for `path` so far (its tokensvc_rpcs_total counter)."""
    counts: collections.Counter[str] = collections.Counter()
    for family in METRICS.rpcs.collect():
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.labels["method"] == path:
                counts[sample.labels["code"]] += int(sample.value)
    return counts


async def settled(path: str, total: int) -> collections.Counter[str]:
    """The server's codes for `path` once it has recorded `total` calls. An aborted call is
    answered before the edge records it, so a record may come a moment after the client's answer."""
    for _ in range(500):
        codes = server_codes(path)
        if sum(codes.values()) >= total:
            return codes
        await asyncio.sleep(0.01)
    raise AssertionError(f"the server never recorded call {total} of {path}")


def client_artifact(stream: bool, failure: RpcFailure) -> bool:
    """grpc/grpc#36066: when the server ends a client stream early (an error before it read every
    message), the asyncio client may report INTERNAL "Internal error from Core" instead of the
    server's status. The server's own record of the status is checked instead."""
    return stream and failure.reason is None and failure.message == "Internal error from Core"


async def send(
    target: Target,
    service: str,
    method: str,
    request: Any,
    metadata: tuple[tuple[str, str], ...],
    *,
    role: str,
    stream: bool = False,
    response_stream: bool = False,
) -> Answer:
    """The status the server answered; asserts it is deliberate, on both sides of the wire.

    `request` is a message (a list of them for the upload stream) or, for raw wire tests, bytes
    (a list of bytes). `role` names the channel (certificate) the call goes out on.
    `response_stream`: the server streams its answer (read to the end).
    """
    name = f"{service}/{method}"
    channel = target.channels[role]
    path = f"/tokensvc.v1.{name}"
    if isinstance(request, bytes) or (stream and request and isinstance(request[0], bytes)):
        make = channel.stream_unary if stream else channel.unary_unary
        call = make(path, request_serializer=None, response_deserializer=None)
    else:
        call = getattr(target.stub(service, role), method)
    expected = target.recorded.get(path)
    before = server_codes(path) if expected is None else await settled(path, expected)
    answer = Answer("OK")
    try:
        if response_stream:
            async for _ in call(request, metadata=metadata, timeout=TIMEOUT):
                pass
        else:
            await call(iter(request) if stream else request, metadata=metadata, timeout=TIMEOUT)
    except grpc.aio.AioRpcError as exc:
        failure = failure_of(exc)
        answer = Answer(failure.code.name, tuple(failure.field_violations), failure.reason)
        if not client_artifact(stream, failure):
            assert failure.code in DELIBERATE, (
                f"{name} answered {failure.code.name}: {failure.message!r} (reason {failure.reason})"
            )
            # Every refusal carries its stable reason (no request here is over max_message_bytes,
            # gRPC's own refusal that comes without one), and a bad argument names its field.
            assert failure.reason is not None, f"{name} answered {answer.code} without a reason: {failure}"
            if failure.code is grpc.StatusCode.INVALID_ARGUMENT:
                assert failure.field_violations, f"{name}: INVALID_ARGUMENT names no field: {failure}"
    after = await settled(path, sum(before.values()) + 1)
    target.recorded[path] = sum(after.values())
    recorded = after - before
    assert sum(recorded.values()) == 1, f"{name}: the server recorded {dict(recorded)}"
    (server_code,) = recorded
    assert server_code == "OK" or grpc.StatusCode[server_code] in DELIBERATE, f"{name}: server {server_code}"
    if answer.code != server_code:
        assert answer.code == "INTERNAL", (
            f"{name}: the client saw {answer.code}, the server sent {server_code}"
        )
        target.artifacts[server_code] += 1
        answer = Answer(server_code, misreported=True)
    return answer
