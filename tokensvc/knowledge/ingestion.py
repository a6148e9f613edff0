"""Background ingestion: the job kind (`tokensvc.jobs`) that turns a queued upload into a
searchable document version, on any replica.

A turn on one ingestion: extract and chunk the stored bytes in an extraction worker (once; the
chunks are staged without vectors), embed the staged chunks batch by batch at the bulk class of
the fair scheduler in the document's namespace (each batch and its progress one commit, so a
killed replica's successor resumes at the first chunk without a vector), then swap the version
in (`IngestionStore.finish`). A refused document (not extractable, over a limit) ends FAILED with
the reason at once; an embedder that fails is retried with backoff, and after `pause_after`
failures in a row the ingestion ends FAILED with the last reason. A cutover of the base to
another embedder meanwhile sends the ingestion back to extraction for the new pins.

An upload that waits for its version (`wait_until_ready`) has this replica's runner claim it at
once and work on it in a task of its own (`IngestionRunner.ingest_now`): the caller's deadline or
cancellation stops the wait, not the work. The runner works as its own database role (the runner
credential); the serving role only queues uploads and reads their state.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
from opentelemetry import trace

from tokensvc.embedders import Demand, EmbedderRegistry, EmbedderSpec, ScheduledEmbedder, WorkClass
from tokensvc.errors import EmbedderUnavailable, InvalidArgument, TokensvcError
from tokensvc.jobs import JobRunner, JobSettings, JobTurn
from tokensvc.knowledge.chunking import ChunkingStrategy
from tokensvc.knowledge.extraction_pool import ExtractionPool
from tokensvc.observability.metrics import METRICS
from tokensvc.retrieval import batch_size_of, embed_texts
from tokensvc.storage.ingestion_records import Extracted, Ingestion, StagedChunk
from tokensvc.storage.ports import IngestionStore, StaleKnowledgeBases
from tokensvc.storage.records import BaseRow, DocumentRow

__all__ = ["IngestionRunner", "IngestionSettings"]

_log = logging.getLogger(__name__)
_tracer = trace.get_tracer("tokensvc.knowledge")


@dataclass(frozen=True)
class IngestionSettings(JobSettings):
    """The job runner's settings (lease, backoff, FAILED after `pause_after` embedder failures in
    a row, parallel ingestions per replica) and ingestion's own."""

    batch_size: int = 0  # chunks per embedding batch and commit; 0: the embedder's own


class IngestionRunner:
    """Runs queued ingestions in the background (`run`), and one at once for an upload that
    waits for it (`ingest_now`)."""

    def __init__(
        self,
        store: IngestionStore,
        embedders: EmbedderRegistry,
        extraction: ExtractionPool,
        settings: IngestionSettings | None = None,
        *,
        runner_id: str | None = None,
    ):
        self.settings = settings or IngestionSettings()
        self.runner_id = runner_id or f"ingestion-{uuid.uuid4()}"
        self._store = store
        self._kind = _Ingesting(store, embedders, extraction, self.settings)
        self._jobs = JobRunner(self._kind, _IngestionJobs(store), self.settings, runner_id=self.runner_id)
        self._inline: set[asyncio.Task[None]] = set()

    def wake(self) -> None:
        """Look for work now instead of at the next poll (an upload was queued here)."""
        self._jobs.wake()

    async def run(self) -> None:
        """Forever: work on up to `parallel` ingestions at once (`tokensvc.jobs.JobRunner.run`)."""
        await self._jobs.run()

    async def step(self) -> bool:
        """Claim one ingestion and work on it until it ends or is lost; False: none to claim."""
        return await self._jobs.step()

    async def ingest_now(self, job: Ingestion) -> DocumentRow | InvalidArgument | None:
        """Claim `job` and work on it in a task of its own, and wait for it: the document once
        the version is READY, or the refusal of its content (the ingestion then ends FAILED);
        None when another runner holds it or the work ended otherwise (the caller reads the
        document). The task runs outside the caller's context (its deadline, its cancellation): a
        caller that stops waiting leaves the work to finish, here or, if this replica dies, on
        another one."""
        claimed = await self._store.claim_one(job, self.runner_id, lease_seconds=self.settings.lease_seconds)
        if claimed is None:
            return None
        self._kind.outcomes[job.id] = None  # what becomes of this one is kept for this caller
        task = asyncio.get_running_loop().create_task(
            self._jobs.work_on(claimed), context=contextvars.Context()
        )
        self._inline.add(task)
        task.add_done_callback(self._inline.discard)
        try:
            await asyncio.shield(task)
        finally:  # also when the caller stops waiting: the work goes on, nobody asks any more
            outcome = self._kind.outcomes.pop(job.id, None)
        return outcome

    async def close(self) -> None:
        """Stop the uploads' own ingestions (their leases expire; another runner resumes them)."""
        for task in list(self._inline):
            task.cancel()
        await asyncio.gather(*self._inline, return_exceptions=True)


class _IngestionJobs:
    """The ingestion store as the runner's leased-job store."""

    def __init__(self, store: IngestionStore):
        self._store = store

    async def claim(self, runner: str, *, lease_seconds: float, busy: Collection[str]) -> Ingestion | None:
        return await self._store.claim(runner, lease_seconds=lease_seconds, busy=busy)

    async def renew(self, job: Ingestion, runner: str, *, lease_seconds: float) -> bool:
        return await self._store.renew(job, runner, lease_seconds=lease_seconds)

    async def record_failure(
        self, job: Ingestion, runner: str, reason: str, *, pause_after: int
    ) -> Ingestion | None:
        return await self._store.record_failure(job, runner, reason, pause_after=pause_after)


class _Ingesting:
    """Ingestion as a kind of job: extract, embed in batches, finish."""

    name = "document ingestion"

    def __init__(
        self,
        store: IngestionStore,
        embedders: EmbedderRegistry,
        extraction: ExtractionPool,
        settings: IngestionSettings,
    ):
        self._store = store
        self._embedders = embedders
        self._extraction = extraction
        self._settings = settings
        # What became of an ingestion worked on by `ingest_now` (its document, or why it was
        # refused), for its waiting upload; only those.
        self.outcomes: dict[str, DocumentRow | InvalidArgument | None] = {}

    async def work(self, job: Ingestion, turn: JobTurn[Ingestion]) -> None:
        with _tracer.start_as_current_span("knowledge.ingest", record_exception=False) as span:
            span.set_attribute("tokensvc.namespace", job.namespace)
            span.set_attribute("tokensvc.upload.bytes", job.size_bytes)
            current: Ingestion | None = job
            while current is not None and not turn.lease.lost:
                current = await self._turn(current, turn)

    async def _turn(self, job: Ingestion, turn: JobTurn[Ingestion]) -> Ingestion | None:
        """One pass: what is left of extraction, embedding and the finish; the ingestion to pass
        over again (a cutover sent it back to extraction), or None when this turn is over."""
        base = await self._store.base_of(job, turn.runner_id)
        if base is None:
            return None  # the lease is lost, or the base was deleted (its ingestions went with it)
        try:
            embedder = self._embedder(_spec(base))
        except TokensvcError as exc:
            return await self._retry(job, turn, exc.message)
        target = self._migration_target(base)
        migration = None if target is None else base.migration_id
        # Staged for other pins (a cutover since), or for a migration that has ended or begun since:
        # cut again for the base as it is now.
        if job.chunks_total is None or job.generation != base.generation or job.migration != migration:
            extracted = await self._extract(job, base, target, turn.runner_id)
            if extracted is None:
                return None
            job = extracted
        embedders = {False: embedder, True: target[0] if target is not None else embedder}
        embedded = await self._embed_staged(job, embedders, turn)
        if embedded is None:
            return None
        try:
            document = await self._store.finish(embedded, turn.runner_id)
        except StaleKnowledgeBases:
            return await self._store.get(embedded)  # PENDING again: for the new pins
        if document is not None:
            if job.id in self.outcomes:
                self.outcomes[job.id] = document
            METRICS.ingestions.labels(outcome="ready").inc()
            _log.info(
                "document ingested",
                extra={
                    "namespace": job.namespace,
                    "chunks": document.chunk_count,
                    "version": document.version,
                },
            )
        return None

    def _migration_target(self, base: BaseRow) -> tuple[ScheduledEmbedder, ChunkingStrategy] | None:
        """The base's backfilling migration's target, when this replica has its embedder as the
        migration pins it: an ingested version is then embedded for it too (as the runner of a
        replica without it would have the migration do later)."""
        spec, chunking = base.migrating_to, base.migrating_chunking
        if spec is None or chunking is None or spec.name not in self._embedders.names:
            return None
        if self._embedders.get(spec.name).spec != spec:
            return None
        strategy = ChunkingStrategy.from_stored(chunking.kind, chunking.size, chunking.overlap)
        return self._embedders.get(spec.name), strategy

    def _embedder(self, spec: EmbedderSpec) -> ScheduledEmbedder:
        if spec.name not in self._embedders.names or self._embedders.get(spec.name).spec != spec:
            raise EmbedderUnavailable(
                f"the knowledge base is pinned to embedder {spec.name!r} (model {spec.model!r}, "
                f"{spec.dimension} dimensions), which this replica does not have configured that way"
            )
        return self._embedders.get(spec.name)

    async def _extract(
        self,
        job: Ingestion,
        base: BaseRow,
        target: tuple[ScheduledEmbedder, ChunkingStrategy] | None,
        runner: str,
    ) -> Ingestion | None:
        """Extract and chunk the bytes for the base's pins (and its migration's `target`) and
        stage the chunks; a refusal ends the ingestion FAILED."""
        content = await self._store.content(job, runner)
        if content is None:
            return None
        strategy = ChunkingStrategy.from_stored(base.chunking, base.chunk_size, base.chunk_overlap)
        strategies = (strategy,) if target is None or target[1] == strategy else (strategy, target[1])
        try:
            extraction = await self._extraction.extract(content, job.content_type, strategies)
        except InvalidArgument as refusal:  # PayloadTooLarge too: the content is the cause
            if job.id in self.outcomes:
                self.outcomes[job.id] = refusal
            await self._store.fail(job, runner, refusal.message.removeprefix(f"{refusal.field}: "))
            METRICS.ingestions.labels(outcome="refused").inc()
            return None
        kinds = [False] if target is None else [False, True]
        chunks = [
            StagedChunk(c.index, c.text, c.start, c.end, tuple(c.heading_path), location, target=for_target)
            for for_target in kinds
            # The target's chunks: its own cut, or the same chunks when it keeps the chunking.
            for c, location in zip(
                extraction.chunkings[-1 if for_target else 0],
                extraction.locations[-1 if for_target else 0],
                strict=True,
            )
        ]
        migration = None if target is None else base.migration_id
        return await self._store.store_extraction(
            job,
            runner,
            Extracted(
                extraction.text, extraction.spans, extraction.media_type, chunks, base.generation, migration
            ),
        )

    async def _embed_staged(
        self, job: Ingestion, embedders: dict[bool, ScheduledEmbedder], turn: JobTurn[Ingestion]
    ) -> Ingestion | None:
        """Embed the staged chunks still without a vector, a batch per commit (the base's chunks
        with its embedder, a migration's target chunks with the target's); the ingestion when none
        is left, None when the turn is over (lease lost, FAILED)."""
        size = self._settings.batch_size or batch_size_of(embedders[False])
        demand = Demand.of(WorkClass.BULK, job.namespace)  # searches and Remembers go first
        while not turn.lease.lost:
            staged = await self._store.unembedded(job, turn.runner_id, limit=size)
            if staged is None:
                return None
            if not staged:
                return job
            vectors: list[tuple[StagedChunk, np.ndarray]] = []
            try:
                for for_target in (False, True):
                    part = [chunk for chunk in staged if chunk.target is for_target]
                    if part:
                        embedded = await embed_texts(embedders[for_target], [c.text for c in part], demand)
                        vectors += zip(part, embedded, strict=True)
            except EmbedderUnavailable as exc:
                if not await turn.failed(job, exc.message):
                    return None  # FAILED (`paused`), or the lease is lost
                continue
            stored = await self._store.store_vectors(job, turn.runner_id, vectors)
            if stored is None:
                return None
            for chunk, _ in vectors:
                METRICS.ingested_chunks.labels(embedders[chunk.target].spec.name).inc()
            job = stored
        return None

    async def _retry(self, job: Ingestion, turn: JobTurn[Ingestion], reason: str) -> Ingestion | None:
        """Count a failure and back off: the ingestion to try again, None once it FAILED."""
        if not await turn.failed(job, reason):
            return None  # FAILED (`paused`), or the lease is lost
        return job

    async def paused(self, job: Ingestion, reason: str) -> None:
        """`job` ended FAILED after too many failures in a row."""
        METRICS.ingestions.labels(outcome="failed").inc()
        _log.warning(
            "document ingestion failed after %d attempts: %s",
            job.failures,
            reason,
            extra={"namespace": job.namespace},
        )


def _spec(base: BaseRow) -> EmbedderSpec:
    return EmbedderSpec(base.embedder, base.model, base.dimension, base.normalized)
