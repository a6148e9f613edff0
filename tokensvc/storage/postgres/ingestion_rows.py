"""An ingestion row as the stores read it (`tokensvc.storage.postgres.ingestion` and the
knowledge store's document views, which show a version still on its way in)."""

from __future__ import annotations

from typing import Any

import asyncpg

from tokensvc.storage.ingestion_records import Ingestion, IngestionState

__all__ = ["INGESTION_COLUMNS", "ingestion_from"]

INGESTION_COLUMNS = (
    "namespace, id, kb_ref, doc_ref, version, content_type, content_sha256, size_bytes, metadata, state, "
    "chunks_done, chunks_total, generation, reason, failures, created_at, updated_at, migration"
)


def ingestion_from(row: asyncpg.Record | dict[str, Any], prefix: str = "") -> Ingestion:
    def get(name: str) -> Any:
        return row[f"{prefix}{name}"]

    return Ingestion(
        id=str(get("id")),
        namespace=get("namespace"),
        kb_ref=get("kb_ref"),
        doc_ref=get("doc_ref"),
        version=get("version"),
        content_type=get("content_type"),
        content_sha256=bytes(get("content_sha256")),
        size_bytes=get("size_bytes"),
        metadata=dict(get("metadata")),
        state=IngestionState(get("state")),
        chunks_done=get("chunks_done"),
        chunks_total=get("chunks_total"),
        generation=get("generation"),
        reason=get("reason"),
        failures=get("failures"),
        created_at=get("created_at"),
        updated_at=get("updated_at"),
        migration=None if get("migration") is None else str(get("migration")),
    )
