"""Property-based fuzzing of every RPC of every service over one live mTLS tokensvc.

Hypothesis generates each request message, valid and invalid: random and edge-case unicode,
huge and empty values, NaN/infinite floats and vectors, unknown enum numbers, deep and wide
filters, random metadata maps, forged page tokens, upload streams in any order, damaged
authorization and trace headers, and one request in ten as damaged wire bytes (truncated,
appended garbage, filters nested past protobuf's depth limit). Each RPC is sent with the
certificate of a role allowed to call it (a launcher with a capability for the launcher RPCs, the
control plane, an admin). Every answer must be OK or a deliberate status that carries a stable
reason, never INTERNAL or UNKNOWN, never a hang; the server's own record of each call
(tokensvc_rpcs_total) must agree. Afterwards the server still answers health checks with
SERVING, and no row of any other tenant changed.

The fuzzed tenant is a namespace of its own; a sentinel tenant (another namespace, with the same
agent name, user id and knowledge-base ref) is filled first and compared row by row at the end.
Credential rotation is fuzzed with UNSPECIFIED and unknown modes only: RELOAD and ROTATE change
the shared credentials.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import hashlib
import json
import math
import string
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import grpc
import numpy as np
import pytest
from google.protobuf import duration_pb2, timestamp_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import RpcFailure, SharedDatabase, failure_of, mtls_channel, role_channel, service_settings
from tokensvc.app import Service
from tokensvc.auth.capabilities import mint_capability
from tokensvc.auth.devpki import DevPaths, issue_client_certificate, load_signing_key
from tokensvc.credentials import FileCredentialSource
from tokensvc.observability import METRICS
from tokensvc.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    capability_pb2,
    capability_pb2_grpc,
    common_pb2,
    knowledge_pb2,
    knowledge_pb2_grpc,
    memory_pb2,
    memory_pb2_grpc,
)

EXAMPLES = 120  # per RPC; 24 RPCs
TIMEOUT = 30.0
RUN = uuid.uuid4().hex[:8]
FUZZ_NS = f"fuzz-{RUN}"
SPARE_NS = f"fuzz-{RUN}-spare"  # valid, owned by the fuzzer, empty
SENTINEL_NS = f"sentinel-{RUN}"
AGENT = "agent-fuzz"
USER = "fuzz-user@example.com"
KB_A, KB_B = "kb-fuzz-a", "kb-fuzz-b"
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


# --- the target ---------------------------------------------------------------------------------


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
    channels: dict[str, grpc.aio.Channel]
    token: str
    known: Known
    baseline: dict[str, Any] = field(default_factory=dict)
    # Calls of each method the server has recorded (tokensvc_rpcs_total) after the last example.
    recorded: dict[str, int] = field(default_factory=dict)

    def stub(self, service_name: str, role: str) -> Any:
        stubs = {
            "CapabilityService": capability_pb2_grpc.CapabilityServiceStub,
            "MemoryService": memory_pb2_grpc.MemoryServiceStub,
            "KnowledgeService": knowledge_pb2_grpc.KnowledgeServiceStub,
            "AdminService": admin_pb2_grpc.AdminServiceStub,
        }
        return stubs[service_name](self.channels[role])


async def table_digests(conn: asyncpg.Connection) -> dict[str, tuple[int, str]]:
    """(row count, md5 of every row in key order) of each tenant table, outside the fuzzed namespaces."""
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
            f"FROM tokensvc.{table} t WHERE namespace <> ALL($1::text[])",
            [FUZZ_NS, SPARE_NS],
        )
        assert row is not None
        digests[table] = (int(row["n"]), str(row["h"]))
    return digests


async def sentinel_rows(conn: asyncpg.Connection) -> list[tuple[Any, ...]]:
    """The sentinel tenant's rows, in full, for an exact before/after comparison."""
    rows: list[tuple[Any, ...]] = []
    for query in (
        "SELECT bucket, id::text, content, metadata::text, embedding::text, created_at, updated_at, expires_at "
        "FROM tokensvc.memories WHERE namespace = $1 ORDER BY bucket, id",
        "SELECT ref, display_name, embedder, created_at FROM tokensvc.knowledge_bases WHERE namespace = $1 ORDER BY ref",
        "SELECT kb_ref, ref, version, content_sha256 FROM tokensvc.documents WHERE namespace = $1 ORDER BY kb_ref, ref, version",
        "SELECT kb_ref, doc_ref, version, chunk_index, text FROM tokensvc.chunks WHERE namespace = $1 "
        "ORDER BY kb_ref, doc_ref, version, chunk_index",
    ):
        rows += [tuple(row) for row in await conn.fetch(query, SENTINEL_NS)]
    return rows


async def superuser_conn(database: SharedDatabase) -> asyncpg.Connection:
    credential = FileCredentialSource(database.superuser_credential_dir).read()
    return await asyncpg.connect(database.dsn, user=credential.username, password=credential.password)


async def state_of(database: SharedDatabase) -> dict[str, Any]:
    conn = await superuser_conn(database)
    try:
        return {
            "tables": await table_digests(conn),
            "sentinel": await sentinel_rows(conn),
            "rotations": await conn.fetchval("SELECT count(*) FROM tokensvc.credential_rotations"),
            "app_password": FileCredentialSource(database.app_credential_dir).read().password,
        }
    finally:
        await conn.close()


def launcher_token(dev: DevPaths, namespace: str, *, kbs: Sequence[str]) -> str:
    kid, key = load_signing_key(dev.signing_key)
    return mint_capability(
        key,
        kid,
        issuer="ctxmesh-control-plane",
        audience="tokensvc",
        namespace=namespace,
        agent=AGENT,
        user=USER,
        per_user=True,
        long_term_memory=True,
        knowledge_bases=list(kbs),
        now=time.time(),
    )


def upload(namespace: str, kb: str, doc: str, text: str, content_type: str) -> list[Any]:
    header = knowledge_pb2.UploadDocumentHeader(
        namespace=namespace, knowledge_base_ref=kb, document_ref=doc, content_type=content_type
    )
    return [
        knowledge_pb2.UploadDocumentRequest(header=header),
        knowledge_pb2.UploadDocumentRequest(content=text.encode()),
    ]


async def seed(target: Target, launcher: str, token: str, namespace: str, *, tag: str) -> None:
    """Memories and two knowledge bases with three documents each, in `namespace`."""
    memory = memory_pb2_grpc.MemoryServiceStub(target.channels[launcher])
    knowledge = knowledge_pb2_grpc.KnowledgeServiceStub(target.channels["control-plane"])
    metadata = (("authorization", f"Bearer {token}"),)
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
    response = await memory.Remember(
        memory_pb2.RememberRequest(items=items), metadata=metadata, timeout=TIMEOUT
    )
    if launcher == "launcher":
        target.known.memory_ids += [result.id for result in response.results]
        page = await memory.ListMemories(
            memory_pb2.ListMemoriesRequest(page_size=2), metadata=metadata, timeout=TIMEOUT
        )
        target.known.memory_page_token = page.next_page_token
    for kb in (KB_A, KB_B):
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


@pytest.fixture(scope="module")
async def fuzz(
    database: SharedDatabase, dev: DevPaths, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Target]:
    state = tmp_path_factory.mktemp("fuzz")
    # No expired-memory sweep while fuzzing: it may delete other tenants' rows, legitimately.
    settings_ = service_settings(
        database, dev, state, knowledge_max_upload_bytes=MAX_UPLOAD, memory_sweep_interval_seconds=3600
    )
    service = Service(settings_)
    await service.start()
    channels: dict[str, grpc.aio.Channel] = {}
    for name, namespace in (("launcher", FUZZ_NS), ("sentinel", SENTINEL_NS)):
        cert, key = issue_client_certificate(
            dev, f"spiffe://dev.local/ns/{namespace}/sa/{AGENT}", state / "certs", name=f"{name}-{RUN}"
        )
        channels[name] = mtls_channel(service.port, dev.ca_cert, cert, key)
    for role in ("control-plane", "admin"):
        channels[role] = role_channel(service.port, dev, role)
    target = Target(service, channels, launcher_token(dev, FUZZ_NS, kbs=[KB_A, KB_B, "kb-missing"]), Known())
    try:
        # The sentinel: same agent name, user id and knowledge-base refs, in another namespace.
        sentinel_token = launcher_token(dev, SENTINEL_NS, kbs=[KB_A, KB_B])
        await seed(target, "sentinel", sentinel_token, SENTINEL_NS, tag="sentinel")
        await seed(target, "launcher", target.token, FUZZ_NS, tag="fuzz")
        control = knowledge_pb2_grpc.KnowledgeServiceStub(channels["control-plane"])
        bases = await control.ListKnowledgeBases(
            knowledge_pb2.ListKnowledgeBasesRequest(namespace=FUZZ_NS, page_size=1), timeout=TIMEOUT
        )
        target.known.kb_page_token = bases.next_page_token
        documents = await control.ListDocuments(
            knowledge_pb2.ListDocumentsRequest(namespace=FUZZ_NS, knowledge_base_ref=KB_A, page_size=1),
            timeout=TIMEOUT,
        )
        target.known.doc_page_token = documents.next_page_token
        admin = admin_pb2_grpc.AdminServiceStub(channels["admin"])
        events = await admin.ListAuditEvents(admin_pb2.ListAuditEventsRequest(page_size=1), timeout=TIMEOUT)
        target.known.audit_page_token = events.next_page_token
        before = await state_of(database)
        assert before["sentinel"], "the sentinel tenant has no rows"
        target.baseline = before
        yield target
        # The module's own last check, for runs that select only some RPCs.
        assert await health_status(channels["admin"]) == health_pb2.HealthCheckResponse.SERVING
        assert await state_of(database) == before
    finally:
        for channel in channels.values():
            await channel.close(grace=None)
        await service.stop(grace=0)


async def health_status(channel: grpc.aio.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    response = await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
    return int(response.status)


# --- strategies: scalars --------------------------------------------------------------------------


def mostly(valid: st.SearchStrategy[Any], other: st.SearchStrategy[Any], percent: int = 85) -> Any:
    """`valid` about `percent`% of the time, else `other`: most requests get past the first check."""
    return st.integers(1, 100).flatmap(lambda n: valid if n <= percent else other)


UNICODE = st.characters(exclude_categories=("Cs",))  # protobuf strings are valid UTF-8
EDGE_STRINGS = [
    "",
    " ",
    "\x00",
    "a\x00b",
    "\t\r\n",
    "\u202e\u2066rtl",
    "\ufeffbom",
    "\uffff\ufffe",
    "\U0010ffff",
    "😀" * 8,
    "e\u0301",
    "\u0130\u0131\u00df",
    "١٢٣",
    "²³",
    "../../etc/passwd",
    "' OR '1'='1' --",
    "%s%n%x",
    "${jndi:ldap://x}",
    "*",
    ",",
    "a,b",
    "\\",
    '"',
    "null",
    "NaN",
    "-1",
    "0",
    "1e309",
    "9" * 25,
    "v1.abc",
    "default",
    "spiffe://dev.local/ns/default/sa/dev-agent",
    "x" * 129,
    "y" * 257,
    "z" * 1025,
]
SMALL_TEXT = st.text(UNICODE, max_size=24) | st.sampled_from(EDGE_STRINGS)
HUGE_TEXT = st.sampled_from([33 * 1024, 70_000, 400_000]).map(lambda n: "é" * (n // 2))
RANDOM_TEXT = st.one_of(st.text(UNICODE, max_size=64), st.sampled_from(EDGE_STRINGS), HUGE_TEXT)


def texts(*known: str) -> st.SearchStrategy[str]:
    """A known-good value most of the time (when given), else random, edge-case or huge text."""
    return mostly(st.sampled_from(known), RANDOM_TEXT) if known else RANDOM_TEXT


def printable(max_size: int = 40) -> st.SearchStrategy[str]:
    return st.text(st.sampled_from(string.printable[:95]), max_size=max_size)


INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
EDGE_INTS = st.sampled_from([-1, 0, 1, 99, 100, 101, 500, 501, 2**31 - 1, -(2**31)])


def sizes() -> st.SearchStrategy[int]:
    """Page sizes and top_k: mostly sensible, sometimes at or past the caps, or anything."""
    return mostly(st.integers(0, 20), EDGE_INTS | INT32)


def enums(*values: int) -> st.SearchStrategy[int]:
    """Known enum numbers mostly; else UNSPECIFIED (0) or any number, mostly unknown ones."""
    return mostly(st.sampled_from(values), st.just(0) | INT32)


DOUBLES = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
    [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e308, -1e308, 5e-324, 2.0**53 + 1]
)
FLOAT32 = st.floats(width=32, allow_nan=True, allow_infinity=True) | st.sampled_from(
    [math.nan, math.inf, -math.inf, 0.0, -1.0, 1.0, 2.0]
)
DURATIONS = mostly(
    st.builds(duration_pb2.Duration, seconds=st.integers(1, 86_400)),
    st.builds(
        duration_pb2.Duration,
        seconds=st.sampled_from([0, 315_360_000, 315_360_001, -1]) | INT64,
        nanos=st.sampled_from([0, 1, 999_999_999, 1_000_000_000, -1]) | INT32,
    ),
)
TIMESTAMPS = mostly(
    st.builds(timestamp_pb2.Timestamp, seconds=st.integers(0, 4_000_000_000)),
    st.builds(
        timestamp_pb2.Timestamp,
        seconds=st.sampled_from([253_402_300_799, 253_402_300_800, -62_135_596_800, -62_135_596_801]) | INT64,
        nanos=st.sampled_from([0, 1, 999_999_999, 1_000_000_000, -1]) | INT32,
    ),
)


def vector_from(seed: int, kind: str) -> bytes:
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(DIMENSION).astype("<f4")
    if kind == "nan":
        values[seed % DIMENSION] = np.nan
    elif kind == "inf":
        values[seed % DIMENSION] = np.inf
    elif kind == "zero":
        values[:] = 0
    elif kind == "huge":
        values[:] = np.float32(3e38)
    elif kind == "tiny":
        values[:] = np.float32(1e-45)
    elif kind == "short":
        values = values[: seed % DIMENSION]
    elif kind == "long":
        values = np.concatenate([values, values])
    return values.tobytes()


VECTORS = mostly(
    st.builds(vector_from, st.integers(0, 2**32), st.just("ok")),
    st.one_of(
        st.binary(max_size=64),
        st.integers(0, 4096).flatmap(lambda n: st.binary(min_size=n, max_size=n)),
        st.builds(
            vector_from,
            st.integers(0, 2**32),
            st.sampled_from(["nan", "inf", "zero", "huge", "tiny", "short", "long"]),
        ),
    ),
    50,
)


# --- strategies: metadata and filters ---------------------------------------------------------

GOOD_KEYS = st.sampled_from(["n", "topic", "a.b", "x-y", "_k", "k" * 64])
KEYS = mostly(GOOD_KEYS, st.sampled_from(["k" * 65, "", "a b", "é", "a\x00"]) | st.text(UNICODE, max_size=12))
GOOD_VALUES = st.one_of(
    st.builds(
        common_pb2.MetadataValue, string_value=st.text(UNICODE.filter(lambda c: c != "\x00"), max_size=20)
    ),
    st.builds(common_pb2.MetadataValue, number_value=st.floats(allow_nan=False, allow_infinity=False)),
    st.builds(common_pb2.MetadataValue, bool_value=st.booleans()),
)
METADATA_VALUES = mostly(
    GOOD_VALUES,
    st.one_of(
        st.builds(common_pb2.MetadataValue, string_value=SMALL_TEXT),
        st.builds(common_pb2.MetadataValue, string_value=st.sampled_from(["z" * 1025, "é" * 600])),
        st.builds(common_pb2.MetadataValue, number_value=DOUBLES),
        st.just(common_pb2.MetadataValue()),
    ),
)
METADATA_MAPS = mostly(
    st.dictionaries(GOOD_KEYS, GOOD_VALUES, max_size=4),
    st.one_of(
        st.dictionaries(KEYS, METADATA_VALUES, max_size=6),
        st.dictionaries(KEYS, METADATA_VALUES, min_size=30, max_size=80),
    ),
)
OPERATORS = enums(*range(1, 10))


@st.composite
def filter_trees(draw: st.DrawFn, max_depth: int = 12, max_width: int = 80) -> common_pb2.Filter:
    """Any Filter message: leaves with random keys, operators and values; AND/OR/NOT nodes up to
    `max_depth` deep and `max_width` wide (a node budget keeps the whole tree a few hundred nodes)."""
    budget = [draw(st.integers(1, 300))]

    def leaf() -> common_pb2.Filter:
        field_filter = common_pb2.FieldFilter(
            key=draw(KEYS), operator=draw(OPERATORS), values=draw(st.lists(METADATA_VALUES, max_size=4))
        )
        if draw(st.booleans()):
            field_filter.value.CopyFrom(draw(METADATA_VALUES))
        return common_pb2.Filter(field=field_filter)

    def node(depth: int) -> common_pb2.Filter:
        budget[0] -= 1
        if depth >= max_depth or budget[0] <= 0:
            return leaf()
        kind = draw(st.sampled_from(["leaf", "leaf", "and", "or", "not", "empty"]))
        if kind == "leaf":
            return leaf()
        if kind == "empty":
            return common_pb2.Filter()
        if kind == "not":
            return common_pb2.Filter(not_filter=node(depth + 1))
        width = draw(st.integers(0, max(0, min(max_width, budget[0]))))
        children = common_pb2.FilterList(filters=[node(depth + 1) for _ in range(width)])
        return common_pb2.Filter(**{f"{kind}_filters": children})

    return node(0)


def exists(key: str = "n") -> common_pb2.Filter:
    return common_pb2.Filter(
        field=common_pb2.FieldFilter(key=key, operator=common_pb2.FILTER_OPERATOR_EXISTS)
    )


def chain(depth: int) -> common_pb2.Filter:
    """AND and NOT nodes alternating `depth` levels above one leaf."""
    node = exists()
    for level in range(depth):
        if level % 2:
            node = common_pb2.Filter(not_filter=node)
        else:
            node = common_pb2.Filter(and_filters=common_pb2.FilterList(filters=[node]))
    return node


def wide(width: int) -> common_pb2.Filter:
    leaves = [
        common_pb2.Filter(
            field=common_pb2.FieldFilter(
                key="n",
                operator=common_pb2.FILTER_OPERATOR_GT,
                value=common_pb2.MetadataValue(number_value=i),
            )
        )
        for i in range(width)
    ]
    return common_pb2.Filter(or_filters=common_pb2.FilterList(filters=leaves))


VALID_FILTERS = st.sampled_from(
    [
        chain(1),
        chain(7),
        wide(3),
        wide(60),
        common_pb2.Filter(
            field=common_pb2.FieldFilter(
                key="topic",
                operator=common_pb2.FILTER_OPERATOR_IN,
                values=[
                    common_pb2.MetadataValue(string_value="sea"),
                    common_pb2.MetadataValue(number_value=1),
                ],
            )
        ),
    ]
)
FILTERS = st.one_of(
    filter_trees(),
    VALID_FILTERS,
    st.sampled_from([chain(12), chain(13), chain(40), wide(80), wide(65)]),
)


def with_filter(request: Any, draw: st.DrawFn) -> Any:
    if draw(st.booleans()):
        request.filter.CopyFrom(draw(FILTERS))
    return request


# --- strategies: page tokens ------------------------------------------------------------------


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def forged_memory_token(filter_bytes: bytes, created: str, memory_id: str) -> str:
    """A ListMemories token as the service builds it (base64url JSON bound to the filter)."""
    tag = hashlib.sha256(filter_bytes).hexdigest()[:16]
    return b64(json.dumps({"c": created, "i": memory_id, "f": tag}).encode())


FORGED_TIMES = st.sampled_from(
    [
        "0001-01-01T00:00:00+14:00",
        "0001-01-01T00:00:00+00:00",
        "9999-12-31T23:59:59-14:00",
        "9999-12-31T23:59:59.999999+00:00",
        "2024-02-30T00:00:00+00:00",
        "2024-01-01T00:00:00",
        "2024-01-01",
        "1970-01-01T00:00:00+00:00",
    ]
)


def page_tokens(known: str) -> st.SearchStrategy[str]:
    """The real token (or none) mostly; else random text, base64url of random bytes, a mutation."""
    mutations = [known[:-1], known + "A", known[::-1], known.upper()] if known else ["x"]
    return mostly(
        st.sampled_from(["", known]),
        st.one_of(
            RANDOM_TEXT,
            st.binary(max_size=80).map(b64),
            st.binary(max_size=600).map(b64),
            SMALL_TEXT.map(lambda s: b64(s.encode())),
            st.sampled_from([*mutations, "=", "====", "AAAA", b64(b"\x00"), b64(b"\xff\xfe")]),
            st.integers(-(2**70), 2**70).map(str),
            st.sampled_from(["²", "١٢٣", "0" * 19, "9" * 19, "9223372036854775807", "9223372036854775808"]),
        ),
        70,
    )


# --- strategies: one request per RPC ----------------------------------------------------------


def bearer(target: Target) -> st.SearchStrategy[tuple[tuple[str, str], ...]]:
    """The valid capability mostly; else none, garbage, two of them or a damaged one. Plus
    random request ids and trace headers, which the edge parses too."""
    valid = (("authorization", f"Bearer {target.token}"),)
    auth = mostly(
        st.just(valid),
        st.one_of(
            st.just(()),
            printable().map(lambda s: (("authorization", s),)),
            printable(200).map(lambda s: (("authorization", f"Bearer {s}"),)),
            st.just((*valid, *valid)),
            st.just((("authorization", f"bearer  {target.token}  "),)),
            st.just((("authorization", f"Bearer {target.token[:-3]}abc"),)),
        ),
        80,
    )
    extra = st.lists(
        st.tuples(st.sampled_from(["x-request-id", "traceparent", "tracestate", "baggage"]), printable(120)),
        max_size=3,
    )
    return st.builds(lambda a, e: (*a, *e), auth, extra)


def memory_ids(target: Target) -> st.SearchStrategy[str]:
    return mostly(st.sampled_from(target.known.memory_ids), st.uuids().map(str) | RANDOM_TEXT)


Build = Callable[[st.DrawFn, Target], Any]


def remember(draw: st.DrawFn, target: Target) -> memory_pb2.RememberRequest:
    def item() -> memory_pb2.RememberItem:
        message = memory_pb2.RememberItem(
            content=draw(texts("a fuzzed fact about tides", "fuzz fact 0 about tides and lighthouses")),
            metadata=draw(METADATA_MAPS),
            idempotency_key=draw(
                mostly(st.sampled_from(["", "key-1", "key-2"]), printable(130) | SMALL_TEXT)
            ),
        )
        if draw(st.booleans()):
            message.ttl.CopyFrom(draw(DURATIONS))
        return message

    count = draw(mostly(st.integers(1, 4), st.sampled_from([0, 256, 257])))
    if count > 8:  # cheap items for the big batches
        return memory_pb2.RememberRequest(
            items=[memory_pb2.RememberItem(content=f"batch {RUN} item {i % 40}") for i in range(count)]
        )
    return memory_pb2.RememberRequest(items=[item() for _ in range(count)])


def search_memories(draw: st.DrawFn, target: Target) -> memory_pb2.SearchMemoriesRequest:
    request = memory_pb2.SearchMemoriesRequest(top_k=draw(sizes()), mode=draw(enums(1, 2)))
    query = draw(st.sampled_from(["text", "text", "vector", "none"]))
    if query == "text":
        request.query_text = draw(texts("tides", "lighthouses keepers"))
    elif query == "vector":
        request.query_vector = draw(VECTORS)
    if draw(st.booleans()):
        request.min_score = draw(FLOAT32)
    return with_filter(request, draw)


def get_memory(draw: st.DrawFn, target: Target) -> memory_pb2.GetMemoryRequest:
    return memory_pb2.GetMemoryRequest(id=draw(memory_ids(target)))


def list_memories(draw: st.DrawFn, target: Target) -> memory_pb2.ListMemoriesRequest:
    request = with_filter(memory_pb2.ListMemoriesRequest(page_size=draw(sizes())), draw)
    filter_bytes = request.filter.SerializeToString(deterministic=True) if request.HasField("filter") else b""
    forged = st.builds(
        forged_memory_token,
        st.just(filter_bytes),
        FORGED_TIMES | st.datetimes().map(lambda d: d.isoformat() + "+00:00"),
        st.uuids().map(str) | SMALL_TEXT,
    )
    request.page_token = draw(mostly(page_tokens(target.known.memory_page_token), forged))
    return request


def update_memory(draw: st.DrawFn, target: Target) -> memory_pb2.UpdateMemoryRequest:
    request = memory_pb2.UpdateMemoryRequest(
        id=draw(memory_ids(target)),
        metadata=draw(METADATA_MAPS),
        replace_metadata=draw(st.booleans()),
        remove_metadata_keys=draw(
            mostly(st.lists(GOOD_KEYS, max_size=3), st.lists(KEYS) | st.just(["k"] * 300))
        ),
    )
    if draw(st.booleans()):
        request.content = draw(texts("an updated fuzz fact"))
    if draw(st.booleans()):
        request.ttl.CopyFrom(draw(DURATIONS))
    return request


def forget(draw: st.DrawFn, target: Target) -> memory_pb2.ForgetRequest:
    many = st.just([str(uuid.uuid4()) for _ in range(257)])
    return memory_pb2.ForgetRequest(ids=draw(mostly(st.lists(memory_ids(target), max_size=5), many, 90)))


def forget_all(draw: st.DrawFn, target: Target) -> memory_pb2.ForgetAllRequest:
    return memory_pb2.ForgetAllRequest()


def verify_capability(draw: st.DrawFn, target: Target) -> capability_pb2.VerifyCapabilityRequest:
    return capability_pb2.VerifyCapabilityRequest()


def derive_session_key(draw: st.DrawFn, target: Target) -> capability_pb2.DeriveSessionKeyRequest:
    return capability_pb2.DeriveSessionKeyRequest(
        conversation_id=draw(texts("conv-1", str(uuid.uuid4()))), scope=draw(enums(1, 2))
    )


def _valid_namespace(value: str) -> bool:
    allowed = string.ascii_lowercase + string.digits + "-"
    return bool(value) and len(value) <= 63 and all(c in allowed for c in value)


def namespaces() -> st.SearchStrategy[str]:
    """The fuzzer's own namespaces, or text that is no valid namespace (never another tenant's)."""
    return mostly(
        st.sampled_from([FUZZ_NS, FUZZ_NS, SPARE_NS]), RANDOM_TEXT.filter(lambda s: not _valid_namespace(s))
    )


def kb_refs() -> st.SearchStrategy[str]:
    return texts(KB_A, KB_B, "kb-fuzz-new", "kb-missing")


def issue_capability(draw: st.DrawFn, target: Target) -> capability_pb2.IssueCapabilityRequest:
    request = capability_pb2.IssueCapabilityRequest(
        namespace=draw(texts(FUZZ_NS, "default")),
        agent=draw(texts(AGENT, "dev-agent")),
        registry=draw(texts("", "registry")),
        long_term_memory=draw(st.booleans()),
        knowledge_bases=draw(
            mostly(st.lists(kb_refs(), max_size=3, unique=True), st.just([f"kb-{i}" for i in range(300)]), 90)
        ),
        run_id=draw(texts("", "run-1")),
        cnf_x5t_s256=draw(
            mostly(st.sampled_from([b"", hashlib.sha256(b"x").digest()]), st.binary(max_size=40))
        ),
    )
    if draw(st.booleans()):
        request.user = draw(texts(USER))
    request.per_user = draw(mostly(st.just(request.HasField("user")), st.booleans()))
    if draw(st.booleans()):
        request.ttl.CopyFrom(draw(DURATIONS))
    return request


def revoke_capability(draw: st.DrawFn, target: Target) -> capability_pb2.RevokeCapabilityRequest:
    request = capability_pb2.RevokeCapabilityRequest(reason=draw(texts("fuzz")))
    which = draw(st.sampled_from(["jti", "run_id", "jti", "run_id", "none"]))
    if which != "none":
        # Never the fuzzer's own capability: fresh or random values only.
        setattr(request, which, draw(texts(f"fuzz-revoked-{uuid.uuid4().hex}")))
    return request


def chunking(draw: st.DrawFn) -> knowledge_pb2.ChunkingStrategy:
    return knowledge_pb2.ChunkingStrategy(
        kind=draw(enums(1, 2, 3)),
        chunk_size=draw(mostly(st.sampled_from([0, 16, 64, 256, 1000]), EDGE_INTS | INT32)),
        chunk_overlap=draw(mostly(st.sampled_from([0, 8, 64]), EDGE_INTS | INT32)),
    )


def create_knowledge_base(draw: st.DrawFn, target: Target) -> knowledge_pb2.CreateKnowledgeBaseRequest:
    request = knowledge_pb2.CreateKnowledgeBaseRequest(
        namespace=draw(namespaces()),
        ref=draw(kb_refs()),
        display_name=draw(texts("Fuzz KB", "")),
        embedder=draw(texts("", "hash")),
    )
    if draw(st.integers(1, 100)) <= 90:  # required; its absence is one more invalid case
        request.chunking.CopyFrom(chunking(draw))
    return request


def get_knowledge_base(draw: st.DrawFn, target: Target) -> knowledge_pb2.GetKnowledgeBaseRequest:
    return knowledge_pb2.GetKnowledgeBaseRequest(namespace=draw(namespaces()), ref=draw(kb_refs()))


def list_knowledge_bases(draw: st.DrawFn, target: Target) -> knowledge_pb2.ListKnowledgeBasesRequest:
    return knowledge_pb2.ListKnowledgeBasesRequest(
        namespace=draw(namespaces()),
        page_size=draw(sizes()),
        page_token=draw(page_tokens(target.known.kb_page_token)),
    )


def delete_knowledge_base(draw: st.DrawFn, target: Target) -> knowledge_pb2.DeleteKnowledgeBaseRequest:
    # KB_A and KB_B stay: SearchKnowledge and the document RPCs need something to find.
    ref = draw(texts("kb-fuzz-new", "kb-missing"))
    return knowledge_pb2.DeleteKnowledgeBaseRequest(namespace=draw(namespaces()), ref=ref)


DOCUMENTS = st.sampled_from(
    [
        b"# Title\n\n## Section\n\nSome text about tides.\n",
        b"<html><head><script>alert(1)</script></head><body><h1>x</h1><p>y</p></body></html>",
        b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n1 0 obj\n<<>>\nendobj\ntrailer\n<<>>\n%%EOF",
        b"\xff\xfe\x00\x00garbage",
        b"\xef\xbb\xbfbom text",
        b"\x00\x00\x00",
        b"",
        b"a" * (MAX_UPLOAD + 1),
        ("\u00e9\u0301" * 5000).encode(),
        b"#" * 10_000,
        b"```\n" * 2000,
        b"<" * 5000,
    ]
)
CONTENT_TYPES = mostly(
    st.sampled_from(["text/plain", "text/markdown", "text/html", "text/plain; charset=utf-8"]),
    st.sampled_from(["application/pdf", "TEXT/HTML", "", "text/html; charset=latin-1"]) | printable(60),
)


def upload_stream(draw: st.DrawFn, target: Target) -> list[knowledge_pb2.UploadDocumentRequest]:
    def header() -> knowledge_pb2.UploadDocumentRequest:
        return knowledge_pb2.UploadDocumentRequest(
            header=knowledge_pb2.UploadDocumentHeader(
                namespace=draw(namespaces()),
                knowledge_base_ref=draw(kb_refs()),
                document_ref=draw(texts(*target.known.doc_refs, "fuzz.md")),
                content_type=draw(CONTENT_TYPES),
                metadata=draw(METADATA_MAPS),
            )
        )

    def content() -> knowledge_pb2.UploadDocumentRequest:
        text = st.text(UNICODE.filter(lambda c: c != "\x00"), max_size=300).map(str.encode)
        return knowledge_pb2.UploadDocumentRequest(
            content=draw(mostly(text, st.binary(max_size=512) | DOCUMENTS))
        )

    if draw(st.integers(1, 100)) <= 80:
        return [header()] + [content() for _ in range(draw(st.integers(1, 4)))]
    parts = draw(st.lists(st.sampled_from(["header", "content", "empty"]), max_size=8))
    made = {"header": header, "content": content, "empty": knowledge_pb2.UploadDocumentRequest}
    return [made[part]() for part in parts]


def get_document(draw: st.DrawFn, target: Target) -> knowledge_pb2.GetDocumentRequest:
    return knowledge_pb2.GetDocumentRequest(
        namespace=draw(namespaces()),
        knowledge_base_ref=draw(kb_refs()),
        document_ref=draw(texts(*target.known.doc_refs)),
    )


def list_documents(draw: st.DrawFn, target: Target) -> knowledge_pb2.ListDocumentsRequest:
    request = knowledge_pb2.ListDocumentsRequest(
        namespace=draw(namespaces()),
        knowledge_base_ref=draw(kb_refs()),
        page_size=draw(sizes()),
        page_token=draw(page_tokens(target.known.doc_page_token)),
    )
    return with_filter(request, draw)


def delete_document(draw: st.DrawFn, target: Target) -> knowledge_pb2.DeleteDocumentRequest:
    return knowledge_pb2.DeleteDocumentRequest(
        namespace=draw(namespaces()),
        knowledge_base_ref=draw(texts(KB_B, "kb-fuzz-new", "kb-missing")),
        document_ref=draw(texts(*target.known.doc_refs)),
    )


def search_knowledge(draw: st.DrawFn, target: Target) -> knowledge_pb2.SearchKnowledgeRequest:
    many = st.just([f"kb-{i}" for i in range(40)])
    request = knowledge_pb2.SearchKnowledgeRequest(
        knowledge_base_refs=draw(mostly(st.lists(kb_refs(), max_size=3), many, 90)),
        query_text=draw(texts("tides", "lighthouse keepers")),
        top_k=draw(sizes()),
        mode=draw(enums(1, 2)),
    )
    if draw(st.booleans()):
        request.min_score = draw(FLOAT32)
    return with_filter(request, draw)


def rotate_credentials(draw: st.DrawFn, target: Target) -> admin_pb2.RotateDatabaseCredentialsRequest:
    # Never RELOAD (1) or ROTATE (2): they change the session's shared credentials.
    mode = draw(st.just(0) | INT32.filter(lambda m: m not in (1, 2)))
    return admin_pb2.RotateDatabaseCredentialsRequest(mode=mode)


def get_credential_status(draw: st.DrawFn, target: Target) -> admin_pb2.GetCredentialStatusRequest:
    return admin_pb2.GetCredentialStatusRequest()


def reload_trust_bundle(draw: st.DrawFn, target: Target) -> admin_pb2.ReloadTrustBundleRequest:
    return admin_pb2.ReloadTrustBundleRequest()


def list_audit_events(draw: st.DrawFn, target: Target) -> admin_pb2.ListAuditEventsRequest:
    request = admin_pb2.ListAuditEventsRequest(
        page_size=draw(sizes()),
        page_token=draw(page_tokens(target.known.audit_page_token)),
        kinds=draw(st.lists(enums(*range(1, 8)), max_size=4)),
    )
    for bound in ("since", "until"):
        if draw(st.booleans()):
            getattr(request, bound).CopyFrom(draw(TIMESTAMPS))
    return request


# --- raw wire bytes ---------------------------------------------------------------------------


def varint(value: int) -> bytes:
    encoded = b""
    while True:
        low, value = value & 0x7F, value >> 7
        encoded += bytes([low | 0x80 if value else low])
        if not value:
            return encoded


def length_delimited(field_number: int, payload: bytes) -> bytes:
    return varint(field_number << 3 | 2) + varint(len(payload)) + payload


def nested_filter(depth: int) -> bytes:
    """A Filter nested `depth` NOT levels deep, past what protobuf builds (or parses) as objects."""
    node = exists().SerializeToString()
    for _ in range(depth):
        node = length_delimited(4, node)
    return node


# The request field holding a Filter, for the RPCs that take one.
FILTER_FIELD = {"ListMemories": 3, "SearchMemories": 5, "ListDocuments": 5, "SearchKnowledge": 5}


def wire(draw: st.DrawFn, rpc_method: str, message: Any) -> bytes:
    """Bytes on the wire that are not what a protobuf library would send for `message`."""
    encoded = message.SerializeToString()
    kind = draw(st.sampled_from(["random", "truncated", "appended", "unknown field", "nested"]))
    if kind == "truncated" and encoded:
        return encoded[: draw(st.integers(0, len(encoded) - 1))]
    if kind == "appended":
        return encoded + draw(st.binary(min_size=1, max_size=16))
    if kind == "unknown field":
        return encoded + length_delimited(1000, draw(st.binary(max_size=16)))  # valid: ignored
    if kind == "nested" and rpc_method in FILTER_FIELD:
        return encoded + length_delimited(FILTER_FIELD[rpc_method], nested_filter(draw(st.integers(90, 200))))
    return draw(st.binary(max_size=64))


@dataclass(frozen=True)
class Rpc:
    service: str
    method: str
    role: str  # launcher (with a capability), control-plane or admin
    build: Build
    stream: bool = False

    @property
    def name(self) -> str:
        return f"{self.service}/{self.method}"


RPCS = [
    Rpc("CapabilityService", "VerifyCapability", "launcher", verify_capability),
    Rpc("CapabilityService", "DeriveSessionKey", "launcher", derive_session_key),
    Rpc("CapabilityService", "IssueCapability", "control-plane", issue_capability),
    Rpc("CapabilityService", "RevokeCapability", "admin", revoke_capability),
    Rpc("MemoryService", "Remember", "launcher", remember),
    Rpc("MemoryService", "SearchMemories", "launcher", search_memories),
    Rpc("MemoryService", "GetMemory", "launcher", get_memory),
    Rpc("MemoryService", "ListMemories", "launcher", list_memories),
    Rpc("MemoryService", "UpdateMemory", "launcher", update_memory),
    Rpc("MemoryService", "Forget", "launcher", forget),
    Rpc("MemoryService", "ForgetAll", "launcher", forget_all),
    Rpc("KnowledgeService", "CreateKnowledgeBase", "control-plane", create_knowledge_base),
    Rpc("KnowledgeService", "GetKnowledgeBase", "admin", get_knowledge_base),
    Rpc("KnowledgeService", "ListKnowledgeBases", "control-plane", list_knowledge_bases),
    Rpc("KnowledgeService", "DeleteKnowledgeBase", "control-plane", delete_knowledge_base),
    Rpc("KnowledgeService", "UploadDocument", "control-plane", upload_stream, stream=True),
    Rpc("KnowledgeService", "GetDocument", "control-plane", get_document),
    Rpc("KnowledgeService", "ListDocuments", "admin", list_documents),
    Rpc("KnowledgeService", "DeleteDocument", "control-plane", delete_document),
    Rpc("KnowledgeService", "SearchKnowledge", "launcher", search_knowledge),
    Rpc("AdminService", "RotateDatabaseCredentials", "admin", rotate_credentials),
    Rpc("AdminService", "GetCredentialStatus", "admin", get_credential_status),
    Rpc("AdminService", "ReloadTrustBundle", "admin", reload_trust_bundle),
    Rpc("AdminService", "ListAuditEvents", "admin", list_audit_events),
]
TALLY: dict[str, collections.Counter[str]] = {rpc.name: collections.Counter() for rpc in RPCS}
ARTIFACT_TALLY: collections.Counter[str] = collections.Counter()


def test_every_rpc_of_every_service_is_fuzzed() -> None:
    declared = {
        f"{service.name}/{method.name}"
        for module in (admin_pb2, capability_pb2, knowledge_pb2, memory_pb2)
        for service in module.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    }
    assert {rpc.name for rpc in RPCS} == declared


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


def client_artifact(rpc: Rpc, failure: RpcFailure) -> bool:
    """grpc/grpc#36066: when the server ends a client stream early (an error before it read every
    message), the asyncio client may report INTERNAL "Internal error from Core" instead of the
    server's status. The server's own record of the status is checked instead."""
    return rpc.stream and failure.reason is None and failure.message == "Internal error from Core"


async def send(target: Target, rpc: Rpc, request: Any, metadata: tuple[tuple[str, str], ...]) -> str:
    """The status the server answered; asserts it is deliberate, on both sides of the wire.

    `request` is a message (a list of them for the upload stream) or, for raw wire tests, bytes
    (a list of bytes).
    """
    channel = target.channels[rpc.role]
    path = f"/tokensvc.v1.{rpc.name}"
    if isinstance(request, bytes) or (rpc.stream and request and isinstance(request[0], bytes)):
        make = channel.stream_unary if rpc.stream else channel.unary_unary
        call = make(path, request_serializer=None, response_deserializer=None)
    else:
        call = getattr(target.stub(rpc.service, rpc.role), rpc.method)
    expected = target.recorded.get(path)
    before = server_codes(path) if expected is None else await settled(path, expected)
    try:
        await call(iter(request) if rpc.stream else request, metadata=metadata, timeout=TIMEOUT)
        code = "OK"
    except grpc.aio.AioRpcError as exc:
        failure = failure_of(exc)
        code = failure.code.name
        if not client_artifact(rpc, failure):
            assert failure.code in DELIBERATE, (
                f"{rpc.name} answered {failure.code.name}: {failure.message!r} (reason {failure.reason})"
            )
            # Every refusal carries its stable reason (no request here is over max_message_bytes,
            # gRPC's own refusal that comes without one).
            assert failure.reason is not None, f"{rpc.name} answered {code} without a reason: {failure}"
    after = await settled(path, sum(before.values()) + 1)
    target.recorded[path] = sum(after.values())
    recorded = after - before
    assert sum(recorded.values()) == 1, f"{rpc.name}: the server recorded {dict(recorded)}"
    (server_code,) = recorded
    assert server_code == "OK" or grpc.StatusCode[server_code] in DELIBERATE, (
        f"{rpc.name}: server {server_code}"
    )
    if code != server_code:
        assert code == "INTERNAL", f"{rpc.name}: the client saw {code}, the server sent {server_code}"
        ARTIFACT_TALLY[server_code] += 1
    return server_code


@pytest.mark.parametrize("rpc", RPCS, ids=lambda rpc: rpc.name.replace("Service/", "."))
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)
@given(data=st.data())
async def test_fuzzed_request_gets_a_deliberate_status(fuzz: Target, rpc: Rpc, data: st.DataObject) -> None:
    request = data.draw(st.composite(lambda draw: rpc.build(draw, fuzz))(), label="request")
    if data.draw(st.integers(1, 100), label="raw") <= 10:
        # One in ten requests goes out as damaged wire bytes instead.
        as_wire = st.composite(lambda draw, message: wire(draw, rpc.method, message))
        if rpc.stream:
            request = [data.draw(as_wire(part)) for part in request] or [b"\xff"]
        else:
            request = data.draw(as_wire(request), label="wire")
    metadata: tuple[tuple[str, str], ...] = ()
    if rpc.role == "launcher":
        metadata = data.draw(bearer(fuzz), label="metadata")
    code = await send(fuzz, rpc, request, metadata)
    TALLY[rpc.name][code] += 1


def found_by_fuzzing() -> list[tuple[str, Any]]:
    """Inputs that once got INTERNAL, UNKNOWN or an unreadable status; each must now be refused
    with INVALID_ARGUMENT and its reason."""
    memory_filter_tag_token = forged_memory_token(b"", "0001-01-01T00:00:00+14:00", str(uuid.uuid4()))
    list_memories = memory_pb2.ListMemoriesRequest(page_size=2).SerializeToString()
    return [
        # str.isdigit() accepts "²", int() does not.
        ("ListAuditEvents", admin_pb2.ListAuditEventsRequest(page_token="²")),
        ("ListAuditEvents", admin_pb2.ListAuditEventsRequest(page_token="9999999999999999999")),
        ("ListAuditEvents", admin_pb2.ListAuditEventsRequest(since=timestamp_pb2.Timestamp(nanos=-1))),
        ("ListAuditEvents", admin_pb2.ListAuditEventsRequest(until=timestamp_pb2.Timestamp(seconds=2**40))),
        # PostgreSQL text cannot hold U+0000.
        ("RevokeCapability", capability_pb2.RevokeCapabilityRequest(jti="a\x00b")),
        ("RevokeCapability", capability_pb2.RevokeCapabilityRequest(run_id="run", reason="\x00")),
        (
            "ListKnowledgeBases",
            knowledge_pb2.ListKnowledgeBasesRequest(namespace=FUZZ_NS, page_token=b64(b"a\x00")),
        ),
        (
            "ListDocuments",
            knowledge_pb2.ListDocumentsRequest(
                namespace=FUZZ_NS, knowledge_base_ref=KB_A, page_token=b64(b"a\x00")
            ),
        ),
        # A page position with no UTC value.
        ("ListMemories", memory_pb2.ListMemoriesRequest(page_token=memory_filter_tag_token)),
        # An error message quoting 100 KB of the caller's input (over gRPC's 16 KiB trailer limit).
        (
            "CreateKnowledgeBase",
            knowledge_pb2.CreateKnowledgeBaseRequest(
                namespace=FUZZ_NS,
                ref="kb-fuzz-new",
                embedder="é" * 50_000,
                chunking=knowledge_pb2.ChunkingStrategy(kind=knowledge_pb2.CHUNKING_KIND_FIXED),
            ),
        ),
        # Bytes that do not parse: corrupt, and a filter nested past protobuf's depth limit.
        ("GetCredentialStatus", b"\xff\xff\xff"),
        ("ListMemories", list_memories + length_delimited(3, nested_filter(150))),
        ("UploadDocument", [b"\x0a\xff"]),
    ]


@pytest.mark.parametrize(("method", "request_"), found_by_fuzzing())
async def test_inputs_found_by_fuzzing_are_invalid_arguments(
    fuzz: Target, method: str, request_: Any
) -> None:
    (rpc,) = [rpc for rpc in RPCS if rpc.method == method]
    metadata = (("authorization", f"Bearer {fuzz.token}"),) if rpc.role == "launcher" else ()
    assert await send(fuzz, rpc, request_, metadata) == "INVALID_ARGUMENT"


async def test_after_fuzzing_the_server_serves_and_other_tenants_are_unchanged(
    fuzz: Target, database: SharedDatabase, capsys: pytest.CaptureFixture[str]
) -> None:
    assert await health_status(fuzz.channels["admin"]) == health_pb2.HealthCheckResponse.SERVING
    assert await health_status(fuzz.channels["launcher"]) == health_pb2.HealthCheckResponse.SERVING
    after = await state_of(database)
    assert after["sentinel"] == fuzz.baseline["sentinel"]
    assert after["tables"] == fuzz.baseline["tables"]
    assert after["rotations"] == fuzz.baseline["rotations"]
    assert after["app_password"] == fuzz.baseline["app_password"]
    # The fuzzed tenant still works end to end.
    memory = memory_pb2_grpc.MemoryServiceStub(fuzz.channels["launcher"])
    await memory.Remember(
        memory_pb2.RememberRequest(items=[memory_pb2.RememberItem(content="still alive")]),
        metadata=(("authorization", f"Bearer {fuzz.token}"),),
        timeout=TIMEOUT,
    )
    total = sum(sum(counts.values()) for counts in TALLY.values())
    lines = [f"fuzzed requests: {total} generated inputs over {len(TALLY)} RPCs"]
    for name, counts in TALLY.items():
        detail = ", ".join(f"{code} {n}" for code, n in counts.most_common())
        lines.append(f"  {name}: {sum(counts.values())} ({detail})")
    if ARTIFACT_TALLY:
        lines.append(
            f"  (the asyncio client misreported {sum(ARTIFACT_TALLY.values())} upload refusals as INTERNAL,"
        )
        lines.append(f"   grpc/grpc#36066; the server had sent {dict(ARTIFACT_TALLY)})")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    if all(TALLY.values()):  # a full run (not a -k selection)
        assert total >= len(RPCS) * EXAMPLES // 2
        assert sum(counts["OK"] for counts in TALLY.values()) > 0
