"""What a migration reports as it moves: an event counted (`tokensvc_embedding_migration_events_total`)
and, with it, a record in the audit trail (kind `embedding_migration`)."""

from __future__ import annotations

from tokensvc.audit import AuditKind, AuditLog, AuditOutcome
from tokensvc.errors import Reason
from tokensvc.observability.metrics import METRICS
from tokensvc.storage.reembedding_records import EmbeddingMigration

__all__ = ["announce", "audit_target"]


def audit_target(migration: EmbeddingMigration) -> str:
    """The migration as the audit trail names it: its id and its subject."""
    return f"migration:{migration.id} {migration.subject}"


async def announce(
    audit: AuditLog,
    migration: EmbeddingMigration,
    event: str,
    *,
    actor: str,
    action: str,
    outcome: AuditOutcome,
    reason: Reason | None = None,
    detail: str = "",
) -> None:
    """Count `event`, then record `action` on the migration in the audit trail."""
    METRICS.migration_events.labels(event).inc()
    await audit.record(
        AuditKind.EMBEDDING_MIGRATION,
        actor=actor,
        action=action,
        target=audit_target(migration),
        outcome=outcome,
        reason=reason,
        detail=detail,
    )
