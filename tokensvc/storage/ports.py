"""The store ports: what the domain needs from storage, as Protocols, with their contracts.

Every implementation (`tokensvc.storage.postgres`, `tokensvc.storage.inprocess`) passes the one
conformance suite in `tests/storage/conformance/`, which checks the contracts written here.
Domain services take these Protocols, never a concrete store, and each the narrowest one it
needs. The re-embedding ports live in `tokensvc.storage.reembedding_ports`, background ingestion's in
`tokensvc.storage.ingestion_ports`; both are re-exported here.
`DatabaseLogins`, `ConnectionPool`, `DatabaseHealth` and `DatabaseServer` are not stores but
adapters to the database server itself (its login roles, connections, liveness and process), so
they have a PostgreSQL implementation only and no in-process stand-in.

Common to every tenant-scoped method: it runs in one transaction bound to `tenant` and sees
nothing outside it (the bucket or namespace predicate, and row-level security in PostgreSQL);
storage trusts its input (validation happened at the API edge and in the domain).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractAsyncContextManager
from datetime import datetime
from typing import Any, Protocol

import numpy as np

from tokensvc.storage.filter_language import Filter
from tokensvc.storage.ingestion_ports import IngestionStore
from tokensvc.storage.records import (
    AuditRecord,
    BaseRow,
    ChunkRow,
    DatabaseCredential,
    DataSubjectReceipt,
    DocumentRow,
    ExportedMemory,
    KnowledgePins,
    MemoryRecord,
    MemorySpace,
    NewMemory,
    PassageRow,
    Revocation,
    RevocationKind,
    RevocationSnapshot,
    RotationEntry,
    SearchOutcome,
    SearchPlan,
    SourceSpan,
    StoredRef,
    Tenant,
)
from tokensvc.storage.reembedding_ports import (
    EmbeddingMigrationStore,
    KnowledgeBackfillStore,
    MemoryBackfillStore,
    MigrationOperationsStore,
    MigrationRunnerStore,
    MigrationStateStore,
)

__all__ = [
    "AuditStore",
    "ConnectionPool",
    "CredentialJournal",
    "CredentialSource",
    "DataSubjectStore",
    "DatabaseHealth",
    "DatabaseLogins",
    "DatabaseServer",
    "EmbeddingMigrationStore",
    "IngestionStore",
    "KnowledgeBackfillStore",
    "KnowledgeStore",
    "MemoryBackfillStore",
    "MemoryStatistics",
    "MemoryStore",
    "MigrationOperationsStore",
    "MigrationRunnerStore",
    "MigrationStateStore",
    "RevocationFeed",
    "RevocationStore",
    "StaleKnowledgeBases",
    "StaleMemorySpace",
    "VectorIndexMaintenance",
]


class StaleKnowledgeBases(Exception):
    """A knowledge search's `expect` no longer holds: re-read the bases and search again."""


class StaleMemorySpace(Exception):
    """A write declared a memory-space generation that is no longer current (a re-embedding
    migration cut over): nothing was written; re-read the space, embed again and retry."""


class MemoryStore(Protocol):
    """Long-term memories: one bucket per (namespace, agent, user), rows deduplicated in it.

    - Every bucket-scoped method reads, changes or counts nothing outside `bucket`.
    - Expired rows (`expires_at <= now`) are never returned, counted, matched or updated (one
      exception: the row count a search measures for its plan includes rows not swept yet).
    - Timestamps come from the store's clock; `created_at == updated_at` on insert, and the
      items of one insert are created in order (later items are newer).
    - Vectors live in the slot of `tenant.generation` (0 when None; `MemorySpace.slot`): writes
      store it there, searches rank by it. `insert` and `update` with a `tenant.generation` that
      is not the space's current one raise `StaleMemorySpace` and write nothing. A content
      change empties the row's other slot. A `NewMemory.next_embedding` goes to the other slot
      (a backfilling migration's target vector, so the migration need not embed that row again)
      only when `tenant.dual_write` names the space's backfilling migration; otherwise, and on
      every write of a tenant that leaves it out, the other slot is left empty.
    - `get_space` reports the target of the space's backfilling migration (`migrating_to`).
    """

    async def get_space(self, tenant: Tenant) -> MemorySpace | None:
        """The space pinned for (tenant.namespace, tenant.agent), None before its first write."""

    async def pin_space(self, tenant: Tenant, space: MemorySpace) -> MemorySpace:
        """Pin `space` unless one is pinned already; returns what is pinned (a pin never changes).
        Also makes sure the space's dimension can be indexed."""

    async def move_buckets(self, tenant: Tenant, target: str, sources: Sequence[str]) -> int:
        """Move the live rows of older-pepper buckets `sources` into `target` (in that order), in
        one transaction; a source row whose content or idempotency key the target already holds
        is dropped. Returns the rows moved."""

    async def find_existing(
        self, tenant: Tenant, bucket: str, hashes: Sequence[bytes], keys: Sequence[str]
    ) -> list[StoredRef]:
        """The live rows whose content hash is in `hashes` or idempotency key in `keys`."""

    async def insert(self, tenant: Tenant, bucket: str, rows: Sequence[NewMemory]) -> list[StoredRef]:
        """All-or-nothing. A row whose content hash or idempotency key is already live in the
        bucket is not inserted; the existing row is reported (`inserted=False`). When an
        idempotency key already belongs to a row with other content, nothing is inserted and
        `AlreadyExists` is raised. Rows are indexed for text search with the space's pinned
        configuration."""

    async def update(
        self,
        tenant: Tenant,
        bucket: str,
        memory_id: str,
        *,
        content: tuple[str, bytes, np.ndarray] | None,
        metadata: dict[str, Any] | None,
        ttl_seconds: int | None,
        embedder: str,
    ) -> MemoryRecord | None:
        """Change what is given (content with its hash and vector; metadata replaced; TTL counted
        from now) and `updated_at`; None when no live row has the id. `AlreadyExists` (field
        `content`) when the new content is another live row's."""

    async def delete(self, tenant: Tenant, bucket: str, ids: Sequence[str]) -> int:
        """Delete the live rows with these ids; returns how many."""

    async def delete_all(self, tenant: Tenant, bucket: str) -> int:
        """Delete every row of the bucket (expired ones too); returns the live rows deleted."""

    async def sweep_expired(self, limit: int = 1000) -> int:
        """Delete up to `limit` expired rows of any bucket; returns how many (0: none left)."""

    async def get(self, tenant: Tenant, bucket: str, memory_id: str, embedder: str) -> MemoryRecord | None:
        """The live row with this id."""

    async def list_page(
        self,
        tenant: Tenant,
        bucket: str,
        *,
        limit: int,
        after: tuple[datetime, str] | None,
        filter_: Filter | None,
        embedder: str,
    ) -> list[MemoryRecord]:
        """Up to `limit` live rows matching the filter, newest first (created_at, then id,
        descending), strictly after the cursor (created_at, id)."""

    async def search(
        self,
        tenant: Tenant,
        bucket: str,
        plan: SearchPlan,
        *,
        row_count: int | None = None,
        count_cap: int,
        filter_: Filter | None,
        embedder: str,
    ) -> SearchOutcome[MemoryRecord]:
        """One search in one transaction. `row_count` is the bucket's size when the caller knows
        it (a caching decorator's, `tokensvc.storage.caching`); else the store counts the
        bucket's rows up to `count_cap` first, in the same transaction (every row of the bucket:
        the filter is not applied, and expired rows not swept yet are counted; the count routes
        the search and sizes BM25's N, it never selects). `plan(row_count)` says what to rank
        (`CandidateQuery`; the retrieval engine's `RoutedPlan`). Returns the candidates (see
        `CandidateQuery`) over the live rows matching the filter, and the count the plan was
        given; a memory's neighbours are the live, matching memories of the bucket created just
        before and after it."""


class DataSubjectStore(Protocol):
    """One end-user's memories across agents (erasure and export requests), and their receipts.

    The end-user is given as buckets only (`tenant.buckets`: the user's bucket under every pepper
    version, of `tenant.namespace`/`tenant.agent`); nothing here sees a user id.
    """

    async def agents(
        self, namespace: str | None, *, after: tuple[str, str] | None, limit: int
    ) -> list[tuple[str, str]]:
        """Up to `limit` memory spaces (namespace, agent) of `namespace` (None: of every one), in
        (namespace, agent) order strictly after `after`."""

    async def erase(self, tenant: Tenant, *, limit: int) -> int:
        """Delete up to `limit` rows of the tenant's buckets (expired ones too), in one
        transaction; returns how many (0: none left)."""

    async def export(
        self, tenant: Tenant, *, after: tuple[str, datetime, str] | None, limit: int
    ) -> list[ExportedMemory]:
        """Up to `limit` live rows of the tenant's buckets in (bucket, created_at, id) order
        strictly after `after`."""

    async def record_receipt(self, receipt: DataSubjectReceipt) -> DataSubjectReceipt:
        """Store the receipt (it is never changed or removed); returns it with its time."""

    async def receipt(self, receipt_id: str) -> DataSubjectReceipt | None:
        """The receipt with this id."""


class KnowledgeStore(Protocol):
    """Knowledge bases of a namespace, their versioned documents and embedded chunks.

    - `tenant.knowledge_bases` limits what is visible: a launcher's roster, or `*` (management).
    - A knowledge base's pinned choices never change; deleting it or a document removes its
      documents and chunks.
    """

    async def create_base(self, tenant: Tenant, base: BaseRow) -> tuple[BaseRow, bool]:
        """Insert unless the ref exists; the stored base and whether it was created."""

    async def get_bases(self, tenant: Tenant, refs: Sequence[str]) -> list[BaseRow]:
        """The bases with these refs (with document counts), ordered by ref."""

    async def bases_for_search(
        self, tenant: Tenant, refs: Sequence[str]
    ) -> tuple[list[BaseRow], KnowledgePins | None]:
        """The bases a search of `refs` plans with (as `get_bases`), and the pins its `search` must
        `expect`: None when they were read just now. A store reads them; a caching decorator may
        answer with what an earlier search read, and the pins that search's transaction checks."""

    async def list_bases(self, tenant: Tenant, *, after: str | None, limit: int) -> list[BaseRow]:
        """Up to `limit` bases with refs after `after`, ordered by ref."""

    async def delete_base(self, tenant: Tenant, ref: str) -> int | None:
        """Delete the base with its documents, chunks and ingestions; the number of its documents
        (with a READY version, or only one on its way in), None if absent."""

    async def document_state(
        self, tenant: Tenant, kb_ref: str, doc_ref: str
    ) -> tuple[BaseRow | None, DocumentRow | None]:
        """The base (document_count 0: not counted) and its document `doc_ref` as a reader sees
        it, each None when absent (no base: no document either), from one snapshot: its newest
        version, the one on its way in when there is one (`IngestionStore`: PENDING, PROCESSING
        or FAILED, with the READY version a search reads meanwhile as `searchable_version`),
        else the READY one."""

    async def document_text(self, tenant: Tenant, kb_ref: str, doc_ref: str, version: int) -> str | None:
        """The extracted text of version `version` of the document (what its passages' offsets
        index; empty for one uploaded before texts were kept); None when that is no longer its
        current version."""

    async def list_documents(
        self, tenant: Tenant, kb_ref: str, *, after: str | None, limit: int, filter_: Filter | None
    ) -> list[DocumentRow] | None:
        """Up to `limit` documents with refs after `after`, ordered by ref, each as
        `document_state` shows it (its newest version; a document only on its way in too) and
        matched by that version's metadata; None when the base does not exist."""

    async def replace_document(
        self,
        tenant: Tenant,
        *,
        kb_ref: str,
        ref: str,
        content_type: str,
        content_sha256: bytes,
        size_bytes: int,
        metadata: dict[str, Any],
        chunks: Sequence[ChunkRow] | None,
        generation: int = 0,
        text: str | None = None,
        next_chunks: Sequence[ChunkRow] | None = None,
        migration_id: str | None = None,
        source_spans: Sequence[SourceSpan] = (),
    ) -> tuple[DocumentRow, bool] | None:
        """Store the next version of a document and swap its chunks atomically (any reader sees
        exactly one version), serialised with other writers of the same document.

        When the current version (read under that serialisation) already has this content, only
        the metadata is replaced: returns (document, False). Otherwise, with `chunks`, the next
        version is written: (document, True), its chunks (with their locations) in `generation`
        and its extracted `text` and `source_spans` kept (a re-chunking migration reads both:
        `PendingDocument`); with `chunks=None` (a metadata-only change of content the caller believed current)
        nothing is written and None is returned.

        A new version is refused with `StaleKnowledgeBases` (nothing written) when the base is no
        longer at `generation`, ordered with a cutover: the caller re-reads the base. `next_chunks`
        (the target's chunks of the base's backfilling migration `migration_id`) are written to
        the next generation, marking the version done for the migration, only while that
        migration is still the base's BACKFILLING one; otherwise they are dropped."""

    async def delete_document(self, tenant: Tenant, kb_ref: str, ref: str) -> int | None:
        """Delete the document, its chunks and its version on its way in (whose runner loses
        the lease); the READY version's chunk count (0 when it had none yet), None if absent."""

    async def search(
        self,
        tenant: Tenant,
        kb_refs: Sequence[str],
        plan: SearchPlan,
        *,
        row_count: int | None = None,
        count_cap: int,
        filter_: Filter | None,
        generations: Sequence[int],
        expect: KnowledgePins | None = None,
    ) -> SearchOutcome[PassageRow]:
        """One search over the chunks of `kb_refs`, each of the generation at the same position
        of `generations` only, in one transaction (as `MemoryStore.search`,
        counting the visible chunks of `kb_refs`, the filter not applied); a chunk's neighbours are
        the chunks before and after it in the same document version. With `expect`, the
        transaction first checks that exactly those refs of the roster exist, each with that
        creation time and generation, and raises `StaleKnowledgeBases` (searching nothing) when not."""


class RevocationStore(Protocol):
    """Capability revocations (by token id or by run), never deleted while they matter.

    A revocation's `revoked_at` is what its row says (an operator may write any time), so a
    reader tracks where it is by the store's clock (`RevocationSnapshot.as_of`), never by it.
    """

    async def revoke(self, kind: RevocationKind, value: str, *, reason: str, revoked_by: str) -> datetime:
        """Record a revocation (idempotent: revoking twice keeps the first); returns when it was
        first revoked."""

    async def since(self, moment: datetime) -> RevocationSnapshot:
        """Revocations whose `revoked_at >= moment` visible now, and the store's clock as they
        were read. A row committed long after its `revoked_at` can be missed by a window, which
        is why pollers also resync with `all()`."""

    async def all(self) -> RevocationSnapshot:
        """Every revocation, and the store's clock as they were read."""

    async def find(self, keys: Collection[tuple[RevocationKind, str]]) -> list[Revocation]:
        """The recorded revocations among `keys` (kind, value), visible now; keys with none are
        left out."""

    async def listen(self, on_announced: Callable[[RevocationKind, str], None]) -> RevocationFeed:
        """Call `on_announced(kind, value)` for every revocation recorded from now on, when it
        becomes visible (at commit), by any writer; a value may be announced more than once.
        An announcement is a hint, not a record: whoever can reach the store may be able to send
        one (PostgreSQL lets any role NOTIFY), so a caller reads it back with `find` before it
        honours it. Malformed announcements are dropped. The feed may end (a lost connection:
        `RevocationFeed.is_open` turns False); the caller polls anyway. Raises when it cannot
        start listening."""


class RevocationFeed(Protocol):
    """A running `RevocationStore.listen`."""

    @property
    def is_open(self) -> bool:
        """Whether announcements still arrive."""

    async def close(self) -> None:
        """Stop listening."""


class AuditStore(Protocol):
    """The audit trail: append-only."""

    async def append(
        self, *, kind: str, actor: str, action: str, target: str, outcome: str, reason: str, detail: str
    ) -> int:
        """Record one event (detail cut to 2,048 characters); returns its id (increasing)."""

    async def page(
        self,
        *,
        before_id: int | None,
        kinds: Sequence[str],
        since: datetime | None,
        until: datetime | None,
        limit: int,
    ) -> list[AuditRecord]:
        """Up to `limit` events newest first (by id), with ids below `before_id`, of the given
        kinds (all when empty), with `since <= occurred_at < until`."""


class MemoryStatistics(Protocol):
    """Counts over every tenant's memories, for operators (counts only: no content, no bucket)."""

    async def rows_by_pepper_version(self) -> dict[int, int]:
        """Live memories per bucket-pepper version; versions without rows are absent."""

    async def rows_by_space(self) -> dict[tuple[str, str], int]:
        """Live memories per (namespace, agent); spaces without rows are absent."""


class VectorIndexMaintenance(Protocol):
    """The approximate-search indexes of memories' vectors, one per (dimension, slot): builds that
    were started and not finished (a search is exact, and correct, where an index is missing)."""

    async def unfinished(self) -> list[tuple[int, int]]:
        """(dimension, slot) of every index whose build started and did not finish, sorted."""

    async def finish(self, dimension: int, slot: int) -> None:
        """Build what is missing of the index of (dimension, slot); a no-op when it is complete.
        Safe beside another replica finishing the same index."""


# --- database credentials (custody and rotation) ------------------------------------------------


class CredentialSource(Protocol):
    """Where a database credential comes from (a mounted secret) and where ROTATE writes one."""

    def read(self) -> DatabaseCredential:
        """The credential as it is now, both fields from the same version of the secret (the
        username without surrounding whitespace, the password without the line breaks ending it,
        as a secret file often ends); `TokensvcError` (reason CREDENTIAL_INVALID) when it cannot
        be read or either field is empty."""

    def stamp(self) -> tuple[int, ...]:
        """A cheap change detector that reads no secret: equal stamps mean nothing changed."""

    def write(self, credential: DatabaseCredential) -> None:
        """Replace the credential atomically: a reader sees the old one or the new one, never a
        mix. `OSError` when it cannot be written (the old credential is then still in place)."""


class CredentialJournal(Protocol):
    """The rotation journal: every credential change, each step recorded before it is taken.

    Holds role names, steps and outcomes only, never a secret. Writers are serialised by the
    rotation lock (`DatabaseLogins.rotation_lock`); readers may run at any time.
    """

    async def begin(self, *, mode: str, actor: str, from_role: str, to_role: str) -> int:
        """Open a rotation (step `started`, outcome `in_progress`); returns its id (increasing)."""

    async def step(self, rotation_id: int, step: str) -> None:
        """Record the step the rotation is about to take."""

    async def close(
        self,
        rotation_id: int,
        *,
        outcome: str,
        reason: str = "",
        step: str | None = None,
        keep_version: bool = False,
    ) -> int | None:
        """Close a rotation with its outcome (and last step, when given). A `succeeded` or
        `recovered` rotation gets the next credential version (1 + the highest so far) and it is
        returned, unless `keep_version` (the credential did not change); otherwise None."""

    async def open_rotations(self) -> list[RotationEntry]:
        """Rotations still `in_progress` (a crash interrupted them), oldest first."""

    async def snapshot(self) -> tuple[int, datetime | None, RotationEntry | None]:
        """One consistent read: the current credential version (0 before any), when it was set,
        and the latest rotation (None before any)."""


class DatabaseLogins(Protocol):
    """Login roles as credential custody needs them; each call uses a session of its own.

    Login failures raise `TokensvcError` with reason CREDENTIAL_INVALID; an unreachable database
    `DatabaseUnavailable`; a statement the database refuses `DatabaseRefused`.
    """

    async def test_login(self, credential: DatabaseCredential) -> None:
        """Log in with `credential` and run one statement; returns when both worked."""

    async def set_password(self, role: str, password: str | None, *, admin: DatabaseCredential) -> None:
        """As `admin`, give login role `role` this password (None: no password login at all).
        The password itself never reaches the database, only its verifier."""

    def rotation_lock(self, credential: DatabaseCredential) -> AbstractAsyncContextManager[bool]:
        """The one deployment-wide rotation lock, tried once in a session of `credential`'s:
        yields True when held (until the block ends), False when another session holds it."""


class ConnectionPool(Protocol):
    """The serving pool as the domain may touch it: its size and retiring its connections."""

    def get_size(self) -> int:
        """Connections open now."""

    def get_idle_size(self) -> int:
        """Connections open and not in use now."""

    def get_max_size(self) -> int:
        """The most connections the pool opens."""

    async def expire_connections(self) -> None:
        """Close idle connections now and busy ones when released; new ones log in afresh."""


# --- the database server ------------------------------------------------------------------------


class DatabaseHealth(Protocol):
    """Whether the database answers, and starting over with fresh connections."""

    async def probe(self) -> bool:
        """True when a connection can be had and answers a trivial statement, each within the
        probe's timeout; False (never an exception) for any database failure."""

    async def reconnect(self) -> None:
        """Drop every pooled connection (idle now, busy when released): after a server restart,
        connections to the previous server process are dead."""


class DatabaseServer(Protocol):
    """A database server process tokensvc runs itself (the embedded PostgreSQL)."""

    def postmaster_pid(self) -> int | None:
        """The server's process id while it runs; None when it is not running."""

    async def restart(self) -> None:
        """Start the server again on the same port and data (crash recovery may take a while)."""
