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
from tokensvc.errors import InvalidArgument, Reason, TokensvcError
from tokensvc.storage.ports import MemoryStatistics

__all__ = ["Administration", "CredentialStatuses", "PepperCount"]

# The service's two database credentials (`Administration.rotate`'s `credential`).
SERVING, RUNNER = "serving", "runner"


@dataclass(frozen=True)
class PepperCount:
    version: int
    rows: int
    current: bool


@dataclass(frozen=True)
class CredentialStatuses:
    serving: CredentialStatus
    peppers: list[PepperCount]
    # None: this replica has no runner credential (it runs no re-embedding migrations).
    runner: CredentialStatus | None


class Administration:
    def __init__(
        self,
        *,
        custodian: CredentialCustodian,
        runner_custodian: CredentialCustodian | None = None,
        bundle: TrustBundle,
        keyring: PepperKeyring,
        audit: AuditLog,
        statistics: MemoryStatistics,
    ):
        self._custodian = custodian
        self._runner_custodian = runner_custodian
        self._bundle = bundle
        self._keyring = keyring
        self._audit = audit
        self._statistics = statistics

    async def rotate(self, mode: str, actor: str, credential: str = SERVING) -> CredentialStatuses:
        """RELOAD or ROTATE the serving or the runner's credential; the statuses after it."""
        if credential == SERVING:
            custodian = self._custodian
        elif credential == RUNNER:
            if self._runner_custodian is None:
                raise TokensvcError(
                    "credential: this replica has no runner credential (setting "
                    "database_runner_credential_dir)",
                    reason=Reason.ROTATION_FAILED,
                    field="credential",
                )
            custodian = self._runner_custodian
        else:
            raise InvalidArgument(
                "credential", "must be DATABASE_CREDENTIAL_SERVING or DATABASE_CREDENTIAL_RUNNER"
            )
        if mode == "reload":
            await custodian.reload(actor)
        elif mode == "rotate":
            await custodian.rotate(actor)
        else:
            raise InvalidArgument(
                "mode", "must be CREDENTIAL_ROTATION_MODE_RELOAD or CREDENTIAL_ROTATION_MODE_ROTATE"
            )
        return await self.status()

    async def status(self) -> CredentialStatuses:
        counts = await self._statistics.rows_by_pepper_version()
        newest = self._keyring.newest_version
        for version in self._keyring.versions:
            counts.setdefault(version, 0)
        peppers = [PepperCount(v, n, v == newest) for v, n in sorted(counts.items())]
        runner = None if self._runner_custodian is None else await self._runner_custodian.status()
        return CredentialStatuses(await self._custodian.status(), peppers, runner)

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
