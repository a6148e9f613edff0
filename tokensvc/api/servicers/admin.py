"""AdminService: thin decode -> one domain call -> encode."""

from __future__ import annotations

import re
from datetime import UTC as _UTC
from datetime import datetime
from typing import Any

import grpc
from google.protobuf import timestamp_pb2

from tokensvc.admin import RUNNER, SERVING, Administration, CredentialStatuses, PepperCount
from tokensvc.api.context import current_call
from tokensvc.api.convert import timestamp
from tokensvc.api.memory_codec import decode_page_size
from tokensvc.audit import AuditKind, AuditOutcome, AuditRecord
from tokensvc.credentials.custody import CredentialStatus
from tokensvc.errors import InvalidArgument, Reason
from tokensvc.v1 import admin_pb2, admin_pb2_grpc, common_pb2

__all__ = ["AdminServicer"]

_Context = grpc.aio.ServicerContext[Any, Any]

_MODES = {
    admin_pb2.CREDENTIAL_ROTATION_MODE_RELOAD: "reload",
    admin_pb2.CREDENTIAL_ROTATION_MODE_ROTATE: "rotate",
}
_MODE_TO_PROTO = {mode: value for value, mode in _MODES.items()}
_CREDENTIALS = {
    admin_pb2.DATABASE_CREDENTIAL_UNSPECIFIED: SERVING,
    admin_pb2.DATABASE_CREDENTIAL_SERVING: SERVING,
    admin_pb2.DATABASE_CREDENTIAL_RUNNER: RUNNER,
}
_OUTCOMES = {
    "in_progress": admin_pb2.ROTATION_OUTCOME_IN_PROGRESS,
    "succeeded": admin_pb2.ROTATION_OUTCOME_SUCCEEDED,
    "failed": admin_pb2.ROTATION_OUTCOME_FAILED,
    "recovered": admin_pb2.ROTATION_OUTCOME_RECOVERED,
}
_KINDS = {
    admin_pb2.AUDIT_EVENT_KIND_CREDENTIAL_ROTATION: AuditKind.CREDENTIAL_ROTATION,
    admin_pb2.AUDIT_EVENT_KIND_CREDENTIAL_RELOAD: AuditKind.CREDENTIAL_RELOAD,
    admin_pb2.AUDIT_EVENT_KIND_TRUST_BUNDLE_RELOAD: AuditKind.TRUST_BUNDLE_RELOAD,
    admin_pb2.AUDIT_EVENT_KIND_CAPABILITY_REVOCATION: AuditKind.CAPABILITY_REVOCATION,
    admin_pb2.AUDIT_EVENT_KIND_KNOWLEDGE_BASE_CREATION: AuditKind.KNOWLEDGE_BASE_CREATION,
    admin_pb2.AUDIT_EVENT_KIND_KNOWLEDGE_BASE_DELETION: AuditKind.KNOWLEDGE_BASE_DELETION,
    admin_pb2.AUDIT_EVENT_KIND_ADMIN_QUERY: AuditKind.ADMIN_QUERY,
    admin_pb2.AUDIT_EVENT_KIND_EMBEDDING_MIGRATION: AuditKind.EMBEDDING_MIGRATION,
    admin_pb2.AUDIT_EVENT_KIND_DATA_SUBJECT_REQUEST: AuditKind.DATA_SUBJECT_REQUEST,
}
# By stored value: a kind or outcome this version does not know (written by a newer replica during
# a rolling upgrade) is UNSPECIFIED, never an error.
_KIND_TO_PROTO = {kind.value: value for value, kind in _KINDS.items()}
_PAGE_TOKEN = re.compile(r"[0-9]{1,19}")
_MAX_EVENT_ID = 2**63 - 1


def _datetime(value: timestamp_pb2.Timestamp, field: str) -> datetime:
    """A request timestamp as an aware datetime; out-of-range seconds or nanos are the caller's error."""
    try:
        return value.ToDatetime(tzinfo=_UTC)
    except (ValueError, OverflowError):
        raise InvalidArgument(field, "is not a valid timestamp") from None


_AUDIT_OUTCOMES = {
    AuditOutcome.STARTED.value: admin_pb2.AUDIT_OUTCOME_STARTED,
    AuditOutcome.SUCCEEDED.value: admin_pb2.AUDIT_OUTCOME_SUCCEEDED,
    AuditOutcome.FAILED.value: admin_pb2.AUDIT_OUTCOME_FAILED,
    AuditOutcome.DENIED.value: admin_pb2.AUDIT_OUTCOME_DENIED,
}


def _status(
    status: CredentialStatus, peppers: list[PepperCount], credential: admin_pb2.DatabaseCredential.ValueType
) -> admin_pb2.CredentialStatus:
    message = admin_pb2.CredentialStatus(
        credential=credential,
        active_role=status.active_role,
        credential_version=status.version,
        pool_size=status.pool_size,
        pool_in_use=status.pool_in_use,
        last_rotation_outcome=_OUTCOMES.get(
            status.last_outcome or "", admin_pb2.ROTATION_OUTCOME_UNSPECIFIED
        ),
        last_rotation_mode=_MODE_TO_PROTO.get(
            status.last_mode or "", admin_pb2.CREDENTIAL_ROTATION_MODE_UNSPECIFIED
        ),
        pepper_versions=[
            admin_pb2.PepperVersionCount(pepper_version=p.version, row_count=p.rows, current=p.current)
            for p in peppers
        ],
    )
    if status.last_rotated_at is not None:
        message.last_rotated_at.CopyFrom(timestamp(status.last_rotated_at))
    return message


def _statuses(
    statuses: CredentialStatuses,
) -> tuple[admin_pb2.CredentialStatus, admin_pb2.CredentialStatus | None]:
    serving = _status(statuses.serving, statuses.peppers, admin_pb2.DATABASE_CREDENTIAL_SERVING)
    runner = (
        None
        if statuses.runner is None
        else _status(statuses.runner, [], admin_pb2.DATABASE_CREDENTIAL_RUNNER)
    )
    return serving, runner


def _event(record: AuditRecord) -> admin_pb2.AuditEvent:
    reason = (
        common_pb2.ErrorReason.Value(f"ERROR_REASON_{record.reason}")
        if record.reason in Reason.__members__
        else common_pb2.ERROR_REASON_UNSPECIFIED
    )
    return admin_pb2.AuditEvent(
        id=str(record.id),
        kind=_KIND_TO_PROTO.get(record.kind, admin_pb2.AUDIT_EVENT_KIND_UNSPECIFIED),
        actor=record.actor,
        action=record.action,
        target=record.target,
        outcome=_AUDIT_OUTCOMES.get(record.outcome, admin_pb2.AUDIT_OUTCOME_UNSPECIFIED),
        reason=reason,
        detail=record.detail,
        occurred_at=timestamp(record.occurred_at),
    )


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    def __init__(self, administration: Administration):
        self._admin = administration

    async def RotateDatabaseCredentials(
        self, request: admin_pb2.RotateDatabaseCredentialsRequest, context: _Context
    ) -> admin_pb2.RotateDatabaseCredentialsResponse:
        mode = _MODES.get(request.mode)
        if mode is None:
            raise InvalidArgument(
                "mode", "must be CREDENTIAL_ROTATION_MODE_RELOAD or CREDENTIAL_ROTATION_MODE_ROTATE"
            )
        credential = _CREDENTIALS.get(request.credential)
        if credential is None:
            raise InvalidArgument(
                "credential", "must be DATABASE_CREDENTIAL_SERVING or DATABASE_CREDENTIAL_RUNNER"
            )
        statuses = await self._admin.rotate(mode, current_call().caller.spiffe_id, credential)
        serving, runner = _statuses(statuses)
        return admin_pb2.RotateDatabaseCredentialsResponse(
            status=serving if credential == SERVING else runner
        )

    async def GetCredentialStatus(
        self, request: admin_pb2.GetCredentialStatusRequest, context: _Context
    ) -> admin_pb2.GetCredentialStatusResponse:
        serving, runner = _statuses(await self._admin.status())
        return admin_pb2.GetCredentialStatusResponse(status=serving, runner_status=runner)

    async def ReloadTrustBundle(
        self, request: admin_pb2.ReloadTrustBundleRequest, context: _Context
    ) -> admin_pb2.ReloadTrustBundleResponse:
        kids, loaded_at = await self._admin.reload_trust_bundle(current_call().caller.spiffe_id)
        response = admin_pb2.ReloadTrustBundleResponse(key_ids=kids)
        if loaded_at is not None:
            response.loaded_at.CopyFrom(timestamp(loaded_at))
        return response

    async def ListAuditEvents(
        self, request: admin_pb2.ListAuditEventsRequest, context: _Context
    ) -> admin_pb2.ListAuditEventsResponse:
        limit = decode_page_size(request.page_size)
        before_id = None
        if request.page_token:
            # ASCII digits only (str.isdigit also takes "²", which int() refuses), within bigint.
            if not _PAGE_TOKEN.fullmatch(request.page_token) or int(request.page_token) > _MAX_EVENT_ID:
                raise InvalidArgument("page_token", "is not a token this service issued")
            before_id = int(request.page_token)
        kinds = []
        for index, kind in enumerate(request.kinds):
            if kind not in _KINDS:
                raise InvalidArgument(f"kinds[{index}]", "is not an audit event kind")
            kinds.append(_KINDS[kind])
        since = _datetime(request.since, "since") if request.HasField("since") else None
        until = _datetime(request.until, "until") if request.HasField("until") else None
        if since and until and since >= until:
            raise InvalidArgument("until", "must be later than since")
        records = await self._admin.audit_page(
            before_id=before_id, kinds=kinds, since=since, until=until, limit=limit + 1
        )
        token = str(records[limit - 1].id) if len(records) > limit else ""
        return admin_pb2.ListAuditEventsResponse(
            events=[_event(r) for r in records[:limit]], next_page_token=token
        )
