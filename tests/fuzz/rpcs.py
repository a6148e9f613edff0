"""One request per RPC, drawn by Hypothesis, for the fuzzed tenant of tests/fuzz/target.py.

Each builder draws a message that is valid most of the time (real ids, refs and page tokens from
`Known`), so requests get past the first check and reach deep code; the rest is anything the
strategies make. Requests only ever name the fuzzer's own namespaces, or text that is no valid
namespace, never another tenant's.
"""

from __future__ import annotations

import hashlib
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from tests.fuzz.hostile import (
    NUMBER_PAGE_TOKENS,
    forged_json_tokens,
    memory_token_values,
    ref_token_values,
    text_page_tokens,
)
from tests.fuzz.strategies import (
    CONTENT_TYPES,
    DOCUMENTS,
    DURATIONS,
    EDGE_INTS,
    FLOAT32,
    FORGED_TIMES,
    GOOD_KEYS,
    INT32,
    KEYS,
    METADATA_MAPS,
    RANDOM_TEXT,
    SMALL_TEXT,
    TIMESTAMPS,
    UNICODE,
    VECTORS,
    enums,
    forged_memory_token,
    mostly,
    page_tokens,
    printable,
    sizes,
    texts,
    with_filter,
)
from tests.fuzz.target import AGENT, FUZZ_NS, KB_A, KB_B, RUN, SPARE_NS, USER, Answer, Target, send
from tests.support import bearer
from tokensvc.v1 import admin_pb2, capability_pb2, knowledge_pb2, memory_pb2


def authorization(target: Target) -> st.SearchStrategy[tuple[tuple[str, str], ...]]:
    """The valid capability mostly; else none, garbage, two of them or a damaged one. Plus
    random request ids and trace headers, which the edge parses too."""
    valid = bearer(target.token)
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


def memory_page_tokens(filter_bytes: bytes) -> st.SearchStrategy[str]:
    """Forged ListMemories tokens bound to the filter: well-typed with odd values, or base64url
    JSON with wrong types, missing and extra keys (see `forged_json_tokens`)."""
    well_typed = st.builds(
        forged_memory_token,
        st.just(filter_bytes),
        FORGED_TIMES | st.datetimes().map(lambda d: d.isoformat() + "+00:00"),
        st.uuids().map(str) | SMALL_TEXT,
    )
    return well_typed | forged_json_tokens(memory_token_values(filter_bytes))


def list_memories(draw: st.DrawFn, target: Target) -> memory_pb2.ListMemoriesRequest:
    request = with_filter(memory_pb2.ListMemoriesRequest(page_size=draw(sizes())), draw)
    filter_bytes = request.filter.SerializeToString(deterministic=True) if request.HasField("filter") else b""
    request.page_token = draw(
        mostly(page_tokens(target.known.memory_page_token), memory_page_tokens(filter_bytes))
    )
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
        # A valid SQL identifier that names no configuration is one of the invalid cases.
        text_search_config=draw(texts("", "", "english", "simple", "german", "no_such_config", "pg_catalog")),
    )
    if draw(st.integers(1, 100)) <= 90:  # required; its absence is one more invalid case
        request.chunking.CopyFrom(chunking(draw))
    return request


def get_knowledge_base(draw: st.DrawFn, target: Target) -> knowledge_pb2.GetKnowledgeBaseRequest:
    return knowledge_pb2.GetKnowledgeBaseRequest(namespace=draw(namespaces()), ref=draw(kb_refs()))


def list_knowledge_bases(draw: st.DrawFn, target: Target) -> knowledge_pb2.ListKnowledgeBasesRequest:
    namespace = draw(namespaces())
    forged = text_page_tokens() | forged_json_tokens(ref_token_values(namespace))
    return knowledge_pb2.ListKnowledgeBasesRequest(
        namespace=namespace,
        page_size=draw(sizes()),
        page_token=draw(mostly(page_tokens(target.known.kb_page_token), forged)),
    )


def delete_knowledge_base(draw: st.DrawFn, target: Target) -> knowledge_pb2.DeleteKnowledgeBaseRequest:
    # KB_A and KB_B stay: SearchKnowledge and the document RPCs need something to find.
    ref = draw(texts("kb-fuzz-new", "kb-missing"))
    return knowledge_pb2.DeleteKnowledgeBaseRequest(namespace=draw(namespaces()), ref=ref)


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
        namespace=draw(namespaces()), knowledge_base_ref=draw(kb_refs()), page_size=draw(sizes())
    )
    request = with_filter(request, draw)
    filter_bytes = request.filter.SerializeToString(deterministic=True) if request.HasField("filter") else b""
    listing = (request.namespace, request.knowledge_base_ref, filter_bytes)
    forged = text_page_tokens() | forged_json_tokens(ref_token_values(*listing))
    request.page_token = draw(mostly(page_tokens(target.known.doc_page_token), forged))
    return request


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
        page_token=draw(mostly(page_tokens(target.known.audit_page_token), NUMBER_PAGE_TOKENS)),
        kinds=draw(st.lists(enums(*range(1, 8)), max_size=4)),
    )
    for bound in ("since", "until"):
        if draw(st.booleans()):
            getattr(request, bound).CopyFrom(draw(TIMESTAMPS))
    return request


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

    @property
    def id(self) -> str:
        return self.name.replace("Service/", ".")

    def draw(self, data: st.DataObject, target: Target) -> Any:
        """One request (a list of messages for a stream), drawn by this RPC's builder."""
        return data.draw(st.composite(lambda draw: self.build(draw, target))(), label=self.method)


async def call(
    target: Target, rpc: Rpc, request: Any, metadata: tuple[tuple[str, str], ...], *, role: str | None = None
) -> Answer:
    """`send` for one RPC, on the certificate of the role allowed to call it unless `role` says."""
    return await send(
        target, rpc.service, rpc.method, request, metadata, role=role or rpc.role, stream=rpc.stream
    )


def rpc_named(method: str) -> Rpc:
    (rpc,) = [rpc for rpc in RPCS if rpc.method == method]
    return rpc


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
