"""The records the store ports take and return: plain frozen dataclasses, no I/O, no SQL.

The domain builds and reads them; every store implementation (PostgreSQL, in-process) speaks
them. They live below the domain so that storage never imports `memory/` or `knowledge/`.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Generic, Literal, TypeVar

import numpy as np

from tokensvc.names import is_dns_label, is_kb_ref
from tokensvc.storage.filter_language import MetadataScalar

__all__ = [
    "ALL_KNOWLEDGE_BASES",
    "MAX_DIMENSION",
    "NOWHERE",
    "AuditRecord",
    "BaseRow",
    "Candidate",
    "CandidateQuery",
    "ChunkRow",
    "ChunkingSpec",
    "DataSubjectReceipt",
    "DatabaseCredential",
    "DocumentRow",
    "DocumentState",
    "EmbedderSpec",
    "ExportedMemory",
    "KnowledgePins",
    "Location",
    "MemoryRecord",
    "MemorySpace",
    "NewMemory",
    "PassageRow",
    "ReceiptKind",
    "Revocation",
    "RevocationKind",
    "RevocationSnapshot",
    "RotationEntry",
    "SearchOutcome",
    "SearchPlan",
    "SourceSpan",
    "StoredChunk",
    "StoredRef",
    "Tenant",
    "pending_vector",
]

T = TypeVar("T")

MAX_DIMENSION = 16_000  # pgvector's `vector` type stores at most 16,000 dimensions.

# --- tenancy ------------------------------------------------------------------------------------

_BUCKET = re.compile(r"v[1-9][0-9]{0,8}\.[a-z2-7]{1,128}")
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
ALL_KNOWLEDGE_BASES = "*"


@dataclass(frozen=True)
class Tenant:
    """What one transaction may see: a namespace, an agent's buckets, knowledge bases.

    Every field is checked here, so a store may declare them to the database as they are: the
    row-level-security policies split the lists on commas, and no element can contain one.
    """

    namespace: str
    agent: str = ""
    buckets: Sequence[str] = ()
    # Knowledge-base refs (a launcher's roster), or ("*",) for control-plane management.
    knowledge_bases: Sequence[str] = ()
    # A memory write's: the memory-space generation it embedded for (refused if no longer current).
    generation: int | None = None
    # A memory write's: the backfilling migration whose target vectors it also writes (its id).
    dual_write: str | None = None

    def __post_init__(self) -> None:
        if not is_dns_label(self.namespace) or (self.agent and not is_dns_label(self.agent)):
            raise ValueError("not a tenant name")
        for bucket in self.buckets:
            if not _BUCKET.fullmatch(bucket):
                raise ValueError("not a bucket id")
        for ref in self.knowledge_bases:
            if ref != ALL_KNOWLEDGE_BASES and not is_kb_ref(ref):
                raise ValueError("not a knowledge base ref")
        if self.generation is not None and self.generation < 0:
            raise ValueError("not a generation")
        if self.dual_write is not None and not _UUID.fullmatch(self.dual_write):
            raise ValueError("not a migration id")


# --- embedders ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class EmbedderSpec:
    """What a memory space or knowledge base pins: vectors from another spec are not comparable."""

    name: str
    model: str
    dimension: int
    normalized: bool

    def __post_init__(self) -> None:
        if not 1 <= self.dimension <= MAX_DIMENSION:
            raise ValueError(f"dimension must be 1..{MAX_DIMENSION}, got {self.dimension}")


# --- long-term memory ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryRecord:
    id: str
    content: str = field(repr=False)
    metadata: dict[str, MetadataScalar] = field(repr=False)
    created_at: datetime
    updated_at: datetime
    expires_at: datetime | None
    embedder: str


@dataclass(frozen=True)
class NewMemory:
    """A memory ready to store: validated, hashed, embedded (unit length)."""

    id: str
    content: str = field(repr=False)
    content_sha256: bytes
    metadata: dict[str, MetadataScalar] = field(repr=False)
    idempotency_key: str | None
    ttl_seconds: int | None
    embedding: np.ndarray = field(repr=False)
    # While a migration backfills the space: the target embedder's vector, for the other slot.
    next_embedding: np.ndarray | None = field(default=None, repr=False)


@dataclass(frozen=True)
class StoredRef:
    """Where an item of an insert ended up: its row, and whether this insert created it."""

    id: str
    content_sha256: bytes
    idempotency_key: str | None
    inserted: bool


@dataclass(frozen=True)
class MemorySpace:
    """What a memory space pins at its first write: the embedder and the text-search config.

    `generation` counts the re-embedding cutovers; a space reads and writes the vector slot of
    its generation (`slot`: 0 for even, 1 for odd), and a migration fills the other one."""

    embedder: EmbedderSpec
    text_config: str
    generation: int = 0
    # The space's backfilling migration, if one runs, and its target: new memories get both vectors.
    migration_id: str | None = field(default=None, compare=False)
    migrating_to: EmbedderSpec | None = field(default=None, compare=False)

    @property
    def slot(self) -> int:
        return self.generation % 2


# --- knowledge bases ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ChunkingSpec:
    """A knowledge base's pinned chunking strategy as stored (kind, size, overlap)."""

    kind: str
    size: int
    overlap: int


@dataclass(frozen=True)
class SourceSpan:
    """A span of the extracted text (code points, `end` exclusive) and where it is in the original:
    its page (PDF) or slide (PPTX), 1-based; or its sheet and row (spreadsheets, CSV and JSON
    Lines: the row as the file numbers it, 1-based). Zero or empty where it does not apply."""

    start: int
    end: int
    page: int = 0
    slide: int = 0
    sheet: str = ""
    row: int = 0


@dataclass(frozen=True)
class Location:
    """Where a passage is in the original: first and last page, slide or row (of `sheet`), each
    pair zero when the format has none. A passage across two pages says both."""

    first_page: int = 0
    last_page: int = 0
    first_slide: int = 0
    last_slide: int = 0
    sheet: str = ""
    first_row: int = 0
    last_row: int = 0

    @property
    def empty(self) -> bool:
        return self == NOWHERE


NOWHERE = Location()


@dataclass(frozen=True)
class StoredChunk:
    """A chunk as stored, without its vector."""

    index: int
    text: str
    start: int
    end: int
    heading_path: tuple[str, ...]
    location: Location = NOWHERE


@dataclass(frozen=True)
class BaseRow:
    namespace: str
    ref: str
    display_name: str
    embedder: str
    model: str
    dimension: int
    normalized: bool
    chunking: str
    chunk_size: int
    chunk_overlap: int
    text_config: str
    created_at: datetime
    document_count: int = 0
    # Which chunks the base reads; bumped by each migration's cutover.
    generation: int = 0
    # The base's backfilling migration, if one runs, and its target: uploads write both.
    migration_id: str | None = field(default=None, compare=False)
    migrating_to: EmbedderSpec | None = field(default=None, compare=False)
    migrating_chunking: ChunkingSpec | None = field(default=None, compare=False)


class DocumentState(enum.StrEnum):
    """Where a document version is: queued, being extracted and embedded, searchable, or given up."""

    PENDING = "pending"
    PROCESSING = "processing"
    READY = "ready"
    FAILED = "failed"


@dataclass(frozen=True)
class DocumentRow:
    """A document's newest version as a reader sees it: READY (searchable: what `documents`
    holds), or still ingesting in the background, or FAILED; `searchable_version` is the version
    a search reads meanwhile (None: none yet)."""

    namespace: str
    kb_ref: str
    ref: str
    version: int
    content_type: str
    content_sha256: bytes
    size_bytes: int
    chunk_count: int  # READY: its chunks; otherwise the chunks to embed (0 until extracted)
    metadata: dict[str, Any]
    created_at: datetime
    text: str | None = None  # the searchable version's extracted text, only when asked for
    state: DocumentState = DocumentState.READY
    chunks_done: int | None = None  # chunks embedded so far (READY: all of them)
    failure_reason: str = ""
    searchable_version: int | None = None

    def __post_init__(self) -> None:
        # A row read from `documents` is a READY version: its own searchable version.
        if self.state is DocumentState.READY:
            if self.chunks_done is None:
                object.__setattr__(self, "chunks_done", self.chunk_count)
            if self.searchable_version is None:
                object.__setattr__(self, "searchable_version", self.version)


@dataclass(frozen=True)
class ChunkRow:
    index: int
    text: str
    start: int
    end: int
    heading_path: tuple[str, ...]
    embedding: np.ndarray
    location: Location = NOWHERE


@dataclass(frozen=True)
class KnowledgePins:
    """What a knowledge search assumed: which refs of its roster exist, each created when and
    at which generation."""

    roster: tuple[str, ...]
    created: tuple[tuple[str, datetime, int], ...]  # (ref, created_at, generation) of the existing ones


@dataclass(frozen=True)
class PassageRow:
    kb_ref: str
    doc_ref: str
    version: int
    chunk_index: int
    text: str
    start: int
    end: int
    heading_path: tuple[str, ...]
    location: Location = NOWHERE


# --- search -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate(Generic[T]):
    """One row a ranker found, with both scores and its neighbours' (None: no neighbour)."""

    item: T
    vector_score: float  # cosine similarity (0 when the search had no query vector)
    text_score: float  # BM25; 0 = no query term matched
    vector_rank: int  # 1-based among the vector ranker's candidates; 0 = not among them
    text_rank: int  # 1-based among the text ranker's candidates; 0 = not among them
    previous: tuple[float, float] | None = None  # (vector_score, text_score)
    next: tuple[float, float] | None = None
    # The neighbours' local keys (within the candidate's partition), when fetched.
    previous_key: Any = None
    next_key: Any = None
    # The rows two places before and after (context too, discounted), and their local keys.
    second_previous: tuple[float, float] | None = None
    second_next: tuple[float, float] | None = None
    second_previous_key: Any = None
    second_next_key: Any = None
    # The BM25 score no row reaches for this query (every term, saturated): TEXT mode's scale.
    text_ideal: float | None = None


@dataclass(frozen=True)
class CandidateQuery:
    """What to rank: built by the domain (tokensvc.retrieval), trusted by the stores.

    Both rankers see only the searchable rows (tenant, liveness, filter). The vector ranker's
    candidates are the true top k by inner product when `exact`, else an HNSW scan's (re-run
    exactly when it comes back short, so results stay complete); the text ranker's are the top k
    by BM25 over the rows matching any query term. Every candidate carries both scores. Both
    rankers break ties by the row's key (a memory's id; a chunk's knowledge base, document,
    version and index), so an exact search returns the same candidates every time.
    """

    vector: np.ndarray | None  # unit length; None: no vector ranker (TEXT mode)
    text: str | None  # the query's words, space-separated (BM25 sums over them); None: no text ranker
    or_text: str  # the same words as websearch_to_tsquery alternatives (what matches)
    text_config: str  # the pinned text-search configuration (an allow-listed name)
    k: int  # candidates per ranker
    row_count: int  # N of BM25's idf
    exact: bool  # exact scan, else HNSW (re-run exactly when short)
    neighbours: bool  # fetch each candidate's neighbours' scores
    bm25_k1: float
    bm25_b: float
    ef_search: int = 100  # the approximate scan's candidate list
    max_scan_tuples: int = 20_000  # the approximate scan's bound on visited tuples
    # The vector ranker's query while it is still being embedded (`vector` is then None): a store
    # may rank by text meanwhile, in the same snapshot, and awaits it before the vector ranker.
    vector_later: Awaitable[np.ndarray] | None = None

    async def with_vector(self) -> CandidateQuery:
        """This query with its vector once embedded (itself when nothing is pending)."""
        if self.vector_later is None:
            return self
        return dataclasses.replace(self, vector=await self.vector_later, vector_later=None)


SearchPlan = Callable[[int], CandidateQuery]
"""Given the searched rows' count (capped), the query to run: routing is the domain's choice."""


def pending_vector(plan: SearchPlan) -> Awaitable[np.ndarray] | None:
    """The query vector a plan's queries will carry once embedded (`vector_later`), when the plan
    says so before it is called (the retrieval engine's plans do); else None."""
    pending: Awaitable[np.ndarray] | None = getattr(plan, "vector_later", None)
    return pending


@dataclass(frozen=True)
class SearchOutcome(Generic[T]):
    """A search's candidates and the row count its plan was given (to cache for the next one)."""

    row_count: int
    candidates: list[Candidate[T]]


# --- capabilities and audit ---------------------------------------------------------------------

RevocationKind = Literal["jti", "run"]


@dataclass(frozen=True)
class Revocation:
    kind: RevocationKind
    value: str
    revoked_at: datetime


@dataclass(frozen=True)
class RevocationSnapshot:
    """Revocations read in one go, and the store's own clock when they were read (`as_of`): where
    the next incremental read starts, whatever times the rows themselves carry."""

    revocations: tuple[Revocation, ...]
    as_of: datetime


# --- end-user data rights -----------------------------------------------------------------------


@dataclass(frozen=True)
class ExportedMemory:
    """One memory of an end-user, as an export lists it: where it lives and what it holds."""

    namespace: str
    agent: str
    bucket: str
    memory: MemoryRecord


@dataclass(frozen=True)
class AgentMemories:
    """How many of an end-user's memories one agent's space held (erased or exported)."""

    namespace: str
    agent: str
    memories: int


class ReceiptKind(enum.StrEnum):
    ERASURE = "erasure"
    EXPORT = "export"


@dataclass(frozen=True)
class DataSubjectReceipt:
    """What an erasure or an export did, never whose: no user id, bucket or content."""

    id: str
    kind: ReceiptKind
    namespace: str  # "" for every namespace
    memories: int
    per_agent: tuple[AgentMemories, ...]
    agents: int  # agents looked at
    key_prefixes: int  # session-memory key prefixes listed
    actor: str
    created_at: datetime | None = None
    complete: bool = True  # False: an erasure cut off part of the way (run it again)


@dataclass(frozen=True)
class AuditRecord:
    id: int
    occurred_at: datetime
    kind: str
    actor: str
    action: str
    target: str
    outcome: str
    reason: str
    detail: str


# --- database credentials -----------------------------------------------------------------------


@dataclass(frozen=True)
class DatabaseCredential:
    """A login role and its password; the password never appears in a repr."""

    username: str
    password: str = field(repr=False)

    @property
    def fingerprint(self) -> str:
        """A short one-way tag telling credentials apart in logs and the journal (not reversible)."""
        return hashlib.sha256(f"{self.username}\0{self.password}".encode()).hexdigest()[:12]


@dataclass(frozen=True)
class RotationEntry:
    """One credential change in the rotation journal (no secret: role names and steps only)."""

    id: int
    mode: str
    actor: str
    from_role: str
    to_role: str
    step: str
    outcome: str
    reason: str
    version: int | None
    started_at: datetime
    updated_at: datetime
