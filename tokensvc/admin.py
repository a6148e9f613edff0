"""Admin operations: credential rotation and status, trust-bundle reload, the audit trail.

Each method is one AdminService RPC's domain call; every state change is audited with the
caller's SPIFFE ID.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from tokensvc.audit import AuditKind, AuditLog, AuditOutcome, AuditRecord
from tokensvc.auth.buckets import PepperKeyring
from tokensvc.auth.keyset import TrustBundle
from tokensvc.credentials.custody import CredentialCustodian, CredentialStatus
from tokensvc.errors import InvalidArgument, TokensvcError
from tokensvc.storage.ports import MemoryStatistics

__all__ = ["Administration", "PepperCount"]


@dataclass(frozen=True)
class PepperCount:
    version: int
    rows: int
    current: bool


class Administration:
    def __init__(
        self,
        *,
        custodian: CredentialCustodian,
        bundle: TrustBundle,
        keyring: PepperKeyring,
        audit: AuditLog,
        statistics: MemoryStatistics,
    ):
        self._custodian = custodian
        self._bundle = bundle
        self._keyring = keyring
        self._audit = audit
        self._statistics = statistics

    async def rotate(self, mode: str, actor: str) -> tuple[CredentialStatus, list[PepperCount]]:
        if mode == "reload":
            await self._custodian.reload(actor)
        elif mode == "rotate":
            await self._custodian.rotate(actor)
        else:
            raise InvalidArgument(
                "mode", "must be CREDENTIAL_ROTATION_MODE_RELOAD or CREDENTIAL_ROTATION_MODE_ROTATE"
            )
        return await self.status()

    async def status(self) -> tuple[CredentialStatus, list[PepperCount]]:
        counts = await self._statistics.rows_by_pepper_version()
        newest = self._keyring.newest_version
        for version in self._keyring.versions:
            counts.setdefault(version, 0)
        peppers = [PepperCount(v, n, v == newest) for v, n in sorted(counts.items())]
        return await self._custodian.status(), peppers

    async def reload_trust_bundle(self, actor: str) -> tuple[list[str], datetime | None]:
        try:
            kids = self._bundle.reload()
        except TokensvcError as exc:
            await self._audit.record(
                AuditKind.TRUST_BUNDLE_RELOAD,
                actor=actor,
                action="reload trust bundle",
                target=str(self._bundle.path),
                outcome=AuditOutcome.FAILED,
                reason=exc.reason,
                detail=exc.message,
            )
            raise
        await self._audit.record(
            AuditKind.TRUST_BUNDLE_RELOAD,
            actor=actor,
            action="reload trust bundle",
            target=str(self._bundle.path),
            detail=f"key ids: {', '.join(kids)}",
        )
        return kids, self._bundle.loaded_at

    async def audit_page(
        self,
        *,
        before_id: int | None,
        kinds: Sequence[AuditKind],
        since: datetime | None,
        until: datetime | None,
        limit: int,
    ) -> list[AuditRecord]:
        return await self._audit.page(before_id=before_id, kinds=kinds, since=since, until=until, limit=limit)
