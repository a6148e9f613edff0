"""The audit trail: every admin action, revocation, rotation, trust-bundle reload and
knowledge-base creation or deletion, with who (the caller's SPIFFE ID), what, when and outcome.

Callers pass identifiers only (refs, run ids, role names); never a secret, token or user id.
Recording must not turn a successful operation into a failure: a failed append is logged.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from datetime import datetime

from tokensvc.errors import Reason
from tokensvc.storage.ports import AuditStore
from tokensvc.storage.records import AuditRecord

__all__ = ["SYSTEM_ACTOR", "AuditKind", "AuditLog", "AuditOutcome", "AuditRecord"]

_log = logging.getLogger(__name__)

# Actions tokensvc takes by itself (a file-triggered reload, recovery after a crash).
SYSTEM_ACTOR = "system:tokensvc"


class AuditKind(enum.StrEnum):
    CREDENTIAL_ROTATION = "credential_rotation"
    CREDENTIAL_RELOAD = "credential_reload"
    TRUST_BUNDLE_RELOAD = "trust_bundle_reload"
    CAPABILITY_REVOCATION = "capability_revocation"
    KNOWLEDGE_BASE_CREATION = "knowledge_base_creation"
    KNOWLEDGE_BASE_DELETION = "knowledge_base_deletion"
    ADMIN_QUERY = "admin_query"
    EMBEDDING_MIGRATION = "embedding_migration"
    DATA_SUBJECT_REQUEST = "data_subject_request"


class AuditOutcome(enum.StrEnum):
    STARTED = "started"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    DENIED = "denied"


class AuditLog:
    def __init__(self, store: AuditStore):
        self._store = store

    async def record(
        self,
        kind: AuditKind,
        *,
        actor: str,
        action: str,
        target: str = "",
        outcome: AuditOutcome = AuditOutcome.SUCCEEDED,
        reason: Reason | None = None,
        detail: str = "",
    ) -> None:
        try:
            await self._store.append(
                kind=kind.value,
                actor=actor,
                action=action,
                target=target,
                outcome=outcome.value,
                reason=reason.value if reason else "",
                detail=detail,
            )
        except Exception as exc:
            _log.error(
                "audit event not recorded",
                extra={"kind": kind.value, "action": action, "error": type(exc).__name__},
            )

    async def page(
        self,
        *,
        before_id: int | None,
        kinds: Sequence[AuditKind],
        since: datetime | None,
        until: datetime | None,
        limit: int,
    ) -> list[AuditRecord]:
        return await self._store.page(
            before_id=before_id, kinds=[k.value for k in kinds], since=since, until=until, limit=limit
        )
