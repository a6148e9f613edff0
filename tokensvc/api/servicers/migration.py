"""MigrationService: re-embedding migrations of memory spaces and knowledge bases (thin: decode,
one call, encode)."""

from __future__ import annotations

from typing import Any

import grpc

from tokensvc.api.context import current_call
from tokensvc.api.convert import decode_uuid, timestamp
from tokensvc.api.knowledge_codec import decode_chunking, encode_chunking
from tokensvc.api.memory_codec import decode_page_size
from tokensvc.api.page_tokens import decode_memory_cursor, encode_memory_cursor, listing_binding
from tokensvc.embedders import EmbedderSpec
from tokensvc.errors import InvalidArgument
from tokensvc.memory.paging import PageCursor
from tokensvc.names import is_dns_label, is_kb_ref
from tokensvc.reembedding import (
    ChunkingSpec,
    EmbeddingMigrations,
    KnowledgeBaseMigration,
    MemorySpaceMigration,
    MigrationEstimate,
    MigrationProgress,
    MigrationState,
)
from tokensvc.v1 import migration_pb2, migration_pb2_grpc

__all__ = ["MigrationServicer"]

_Context = grpc.aio.ServicerContext[Any, Any]
_PHASES = {
    MigrationState.BACKFILLING: migration_pb2.MIGRATION_PHASE_BACKFILLING,
    MigrationState.PAUSED: migration_pb2.MIGRATION_PHASE_PAUSED,
    MigrationState.RETIRING: migration_pb2.MIGRATION_PHASE_RETIRING,
    MigrationState.SUCCEEDED: migration_pb2.MIGRATION_PHASE_SUCCEEDED,
    MigrationState.CANCELLING: migration_pb2.MIGRATION_PHASE_CANCELLING,
    MigrationState.CANCELLED: migration_pb2.MIGRATION_PHASE_CANCELLED,
}
_LISTING = listing_binding("embedding-migrations")
_MAX_EMBEDDER_NAME = 64


def _embedder(spec: EmbedderSpec) -> migration_pb2.EmbedderDescription:
    return migration_pb2.EmbedderDescription(name=spec.name, model=spec.model, dimension=spec.dimension)


def _migration(progress: MigrationProgress) -> migration_pb2.EmbeddingMigration:
    m = progress.migration
    message = migration_pb2.EmbeddingMigration(
        id=m.id,
        source=_embedder(m.source),
        target=_embedder(m.target),
        phase=_PHASES.get(m.state, migration_pb2.MIGRATION_PHASE_UNSPECIFIED),
        reason=m.reason,
        rows_total=m.rows_total,
        rows_done=m.rows_done,
        rows_per_second=progress.rows_per_second,
        eta_seconds=progress.eta_seconds or 0.0,
        created_by=m.created_by,
    )
    match m:
        case KnowledgeBaseMigration():
            message.knowledge_base.CopyFrom(
                migration_pb2.KnowledgeBaseRef(namespace=m.namespace, ref=m.kb_ref)
            )
            for chunking, field in (
                (m.source_chunking, "source_chunking"),
                (m.target_chunking, "target_chunking"),
            ):
                getattr(message, field).CopyFrom(
                    encode_chunking(chunking.kind, chunking.size, chunking.overlap)
                )
        case MemorySpaceMigration():
            message.memory_space.CopyFrom(migration_pb2.MemorySpaceRef(namespace=m.namespace, agent=m.agent))
    for name in ("created_at", "updated_at", "cut_over_at", "finished_at"):
        value = getattr(m, name)
        if value is not None:
            getattr(message, name).CopyFrom(timestamp(value))
    return message


def _estimate(estimate: MigrationEstimate) -> migration_pb2.MigrationEstimate:
    return migration_pb2.MigrationEstimate(
        rows=estimate.rows,
        source=_embedder(estimate.source),
        target=_embedder(estimate.target),
        embedder_items_per_second=estimate.items_per_second,
        estimated_seconds=estimate.seconds,
    )


def _migration_id(value: str) -> str:
    return decode_uuid(value, "id", "a migration id")


class MigrationServicer(migration_pb2_grpc.MigrationServiceServicer):
    def __init__(self, migrations: EmbeddingMigrations):
        self._migrations = migrations

    async def StartEmbeddingMigration(
        self, request: migration_pb2.StartEmbeddingMigrationRequest, context: _Context
    ) -> migration_pb2.StartEmbeddingMigrationResponse:
        if not request.embedder or len(request.embedder) > _MAX_EMBEDDER_NAME:
            raise InvalidArgument(
                "embedder", f"must be a configured embedder's name (1 to {_MAX_EMBEDDER_NAME} characters)"
            )
        actor = current_call().caller.spiffe_id
        chosen = request.WhichOneof("target")
        if chosen == "knowledge_base":
            base = request.knowledge_base
            if not is_dns_label(base.namespace):
                raise InvalidArgument("knowledge_base.namespace", "must be a DNS label")
            if not is_kb_ref(base.ref):
                raise InvalidArgument("knowledge_base.ref", "must be a knowledge base ref")
            chunking = None
            if request.HasField("chunking"):
                strategy = decode_chunking(request.chunking, True)
                chunking = ChunkingSpec(str(strategy.kind.value), strategy.chunk_size, strategy.chunk_overlap)
            migration, estimate = await self._migrations.start_knowledge_base(
                base.namespace, base.ref, request.embedder, chunking, dry_run=request.dry_run, actor=actor
            )
        elif chosen == "memory_space":
            space = request.memory_space
            if not is_dns_label(space.namespace):
                raise InvalidArgument("memory_space.namespace", "must be a DNS label")
            if not is_dns_label(space.agent):
                raise InvalidArgument("memory_space.agent", "must be a DNS label")
            if request.HasField("chunking"):
                raise InvalidArgument("chunking", "only a knowledge base has a chunking strategy")
            migration, estimate = await self._migrations.start(
                space.namespace, space.agent, request.embedder, dry_run=request.dry_run, actor=actor
            )
        else:
            raise InvalidArgument("memory_space", "is required (or knowledge_base)")
        response = migration_pb2.StartEmbeddingMigrationResponse(estimate=_estimate(estimate))
        if migration is not None:
            response.migration.CopyFrom(_migration(MigrationProgress(migration, 0.0, None)))
        return response

    async def GetEmbeddingMigration(
        self, request: migration_pb2.GetEmbeddingMigrationRequest, context: _Context
    ) -> migration_pb2.GetEmbeddingMigrationResponse:
        progress = await self._migrations.get(_migration_id(request.id))
        return migration_pb2.GetEmbeddingMigrationResponse(migration=_migration(progress))

    async def ListEmbeddingMigrations(
        self, request: migration_pb2.ListEmbeddingMigrationsRequest, context: _Context
    ) -> migration_pb2.ListEmbeddingMigrationsResponse:
        limit = decode_page_size(request.page_size)
        cursor = decode_memory_cursor(request.page_token, _LISTING)
        before = None if cursor is None else (cursor.created_at, cursor.id)
        found = await self._migrations.page(limit=limit + 1, before=before)
        token = ""
        if len(found) > limit:
            last = found[limit - 1].migration
            assert last.created_at is not None
            token = encode_memory_cursor(PageCursor(last.created_at, last.id), _LISTING)
        return migration_pb2.ListEmbeddingMigrationsResponse(
            migrations=[_migration(p) for p in found[:limit]], next_page_token=token
        )

    async def CancelEmbeddingMigration(
        self, request: migration_pb2.CancelEmbeddingMigrationRequest, context: _Context
    ) -> migration_pb2.CancelEmbeddingMigrationResponse:
        progress = await self._migrations.cancel(_migration_id(request.id), current_call().caller.spiffe_id)
        return migration_pb2.CancelEmbeddingMigrationResponse(migration=_migration(progress))

    async def ResumeEmbeddingMigration(
        self, request: migration_pb2.ResumeEmbeddingMigrationRequest, context: _Context
    ) -> migration_pb2.ResumeEmbeddingMigrationResponse:
        progress = await self._migrations.resume(_migration_id(request.id), current_call().caller.spiffe_id)
        return migration_pb2.ResumeEmbeddingMigrationResponse(migration=_migration(progress))
