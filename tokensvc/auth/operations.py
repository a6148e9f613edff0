"""The capability service's domain operations: session keys, issuing, revoking.

Servicers call exactly one of these per RPC. Inputs are already decoded; scope comes from the
edge (`TenantScope`), never from request fields.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime

from tokensvc.audit import AuditKind, AuditLog
from tokensvc.auth.issuer import CapabilityIssuer, IssuedCapability, IssueRequest, signing_key_missing
from tokensvc.auth.revocation import RevocationList
from tokensvc.auth.scope import TenantScope
from tokensvc.auth.session_keys import SessionKey, SessionScope, derive_session_key
from tokensvc.errors import InvalidArgument
from tokensvc.storage.records import RevocationKind

__all__ = ["CapabilityOperations"]

_MAX_REVOKE_VALUE = 256
_MAX_REASON = 1024


class CapabilityOperations:
    def __init__(
        self,
        *,
        revocations: RevocationList,
        issuer: CapabilityIssuer | None,
        audit: AuditLog,
        qualify_shared_keys: bool = False,
        clock: Callable[[], float] = time.time,
    ):
        self._revocations = revocations
        self._qualify_shared = qualify_shared_keys
        self._audit = audit
        self._issuer = issuer
        self._clock = clock

    def session_key(
        self, scope: TenantScope, conversation_id: str, requested: SessionScope
    ) -> tuple[SessionKey, list[str]]:
        """The key, and the same conversation's keys under older pepper versions (per-user only)."""

        def derive(bucket: str) -> SessionKey:
            return derive_session_key(
                namespace=scope.namespace,
                agent=scope.agent,
                registry=scope.registry,
                per_user=scope.per_user,
                user_bucket=bucket if scope.per_user else None,
                conversation_id=conversation_id,
                scope=requested,
                qualify_shared=self._qualify_shared,
            )

        current = derive(scope.bucket_id)
        if not current.per_user:
            return current, []
        return current, [derive(bucket).key for bucket in scope.previous_bucket_ids]

    def issue(self, request: IssueRequest) -> IssuedCapability:
        if self._issuer is None:
            raise signing_key_missing()
        return self._issuer.issue(request, self._clock())

    async def revoke(self, kind: RevocationKind, value: str, *, reason: str, revoked_by: str) -> datetime:
        field = "jti" if kind == "jti" else "run_id"
        if not value.strip() or len(value) > _MAX_REVOKE_VALUE:
            raise InvalidArgument(field, f"must be 1..{_MAX_REVOKE_VALUE} characters")
        if len(reason) > _MAX_REASON:
            raise InvalidArgument("reason", f"must be at most {_MAX_REASON} characters")
        # PostgreSQL text cannot hold U+0000: refuse it here rather than fail in the database.
        for name, text in ((field, value), ("reason", reason)):
            if "\x00" in text:
                raise InvalidArgument(name, "must not contain U+0000 (NUL)")
        revoked_at = await self._revocations.revoke(kind, value, reason=reason, revoked_by=revoked_by)
        await self._audit.record(
            AuditKind.CAPABILITY_REVOCATION,
            actor=revoked_by,
            action=f"revoke {field}",
            target=value,
            detail=reason,
        )
        return revoked_at
