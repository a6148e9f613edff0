"""AdminService over mTLS on the shared database: validation, trust bundles, the audit trail, roles.

Nothing here rotates the database credential (the credential tests run on their own database).
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator, Awaitable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.api.memory_support import Launchers
from tests.support import RpcFailure, SharedDatabase, failure_of, role_channel, superuser
from tokensvc.app import Service
from tokensvc.auth.devpki import ADMIN_SPIFFE_ID, DevPaths
from tokensvc.credentials import FileCredentialSource
from tokensvc.v1 import admin_pb2, admin_pb2_grpc, common_pb2

TIMEOUT = 20.0
BUNDLE_EVENTS = admin_pb2.AUDIT_EVENT_KIND_TRUST_BUNDLE_RELOAD


class AdminCalls:
    def __init__(self, channel: grpc.aio.Channel):
        self.stub = admin_pb2_grpc.AdminServiceStub(channel)

    async def reload_bundle(self) -> admin_pb2.ReloadTrustBundleResponse:
        return await self.stub.ReloadTrustBundle(admin_pb2.ReloadTrustBundleRequest(), timeout=TIMEOUT)

    async def status(self) -> admin_pb2.CredentialStatus:
        response = await self.stub.GetCredentialStatus(
            admin_pb2.GetCredentialStatusRequest(), timeout=TIMEOUT
        )
        return response.status

    async def page(
        self,
        *kinds: int,
        page_size: int = 0,
        page_token: str = "",
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> admin_pb2.ListAuditEventsResponse:
        request = admin_pb2.ListAuditEventsRequest(
            page_size=page_size,
            page_token=page_token,
            kinds=kinds,  # type: ignore[arg-type]
        )
        if since is not None:
            request.since.FromDatetime(since)
        if until is not None:
            request.until.FromDatetime(until)
        return await self.stub.ListAuditEvents(request, timeout=TIMEOUT)

    async def events(self, *kinds: int, **window: Any) -> list[admin_pb2.AuditEvent]:
        """Every matching event, newest first, following the page tokens."""
        events: list[admin_pb2.AuditEvent] = []
        token = ""
        while True:
            response = await self.page(*kinds, page_size=50, page_token=token, **window)
            events.extend(response.events)
            token = response.next_page_token
            if not token:
                return events


async def failure(call: Awaitable[Any]) -> RpcFailure:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return failure_of(caught.value)


@pytest.fixture
async def admin(service: Service, dev: DevPaths) -> AsyncIterator[AdminCalls]:
    async with role_channel(service.port, dev, "admin") as channel:
        yield AdminCalls(channel)


def bundle_kids(path: Path) -> list[str]:
    return [key["kid"] for key in json.loads(path.read_text())["keys"]]


async def bundle_reloads(admin: AdminCalls, count: int) -> None:
    for _ in range(count):
        await admin.reload_bundle()
        await asyncio.sleep(0.01)  # distinct timestamps


# --- RotateDatabaseCredentials validation --------------------------------------------------------


@pytest.mark.parametrize("mode", [admin_pb2.CREDENTIAL_ROTATION_MODE_UNSPECIFIED, 99])
async def test_rotate_without_a_known_mode_is_invalid_argument_naming_mode(
    admin: AdminCalls, mode: int
) -> None:
    before = await admin.status()
    refused = await failure(
        admin.stub.RotateDatabaseCredentials(
            admin_pb2.RotateDatabaseCredentialsRequest(mode=mode),  # type: ignore[arg-type]
            timeout=TIMEOUT,
        )
    )
    assert (refused.code, refused.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT")
    assert refused.field_violations == ["mode"]
    after = await admin.status()
    assert (after.active_role, after.credential_version) == (before.active_role, before.credential_version)


# --- trust bundles ------------------------------------------------------------------------------


async def test_reload_trust_bundle_returns_the_key_ids_and_is_audited(
    admin: AdminCalls, dev: DevPaths
) -> None:
    since = datetime.now(UTC) - timedelta(milliseconds=10)
    response = await admin.reload_bundle()
    assert list(response.key_ids) == bundle_kids(dev.trust_bundle)
    assert response.key_ids
    loaded_at = response.loaded_at.ToDatetime(tzinfo=UTC)
    assert since <= loaded_at <= datetime.now(UTC) + timedelta(seconds=1)

    (event,) = await admin.events(BUNDLE_EVENTS, since=since)
    assert (event.actor, event.outcome, event.reason) == (
        ADMIN_SPIFFE_ID,
        admin_pb2.AUDIT_OUTCOME_SUCCEEDED,
        common_pb2.ERROR_REASON_UNSPECIFIED,
    )
    assert event.target == str(dev.trust_bundle)
    assert all(kid in event.detail for kid in response.key_ids)


@pytest.mark.parametrize(
    "content",
    [b"{not json", b'{"keys": [{"kty": "OKP", "crv": "Ed25519", "kid": "half', b"", b'{"keys": "none"}'],
    ids=["garbage", "half-written", "empty", "wrong-shape"],
)
async def test_a_malformed_trust_bundle_is_refused_and_the_old_keys_still_verify(
    start_service: Any, dev: DevPaths, tmp_path: Path, content: bytes
) -> None:
    bundle = tmp_path / "trust-bundle.jwks"
    shutil.copyfile(dev.trust_bundle, bundle)
    service = await start_service(trust_bundle_file=str(bundle))
    launchers = Launchers(service, dev, tmp_path / "launchers")
    try:
        caller = launchers.caller()
        bucket = await caller.bucket()
        async with role_channel(service.port, dev, "admin") as channel:
            admin = AdminCalls(channel)
            since = datetime.now(UTC) - timedelta(seconds=1)
            bundle.write_bytes(content)
            refused = await failure(admin.reload_bundle())
            assert (refused.code, refused.reason) == (
                grpc.StatusCode.FAILED_PRECONDITION,
                "TRUST_BUNDLE_INVALID",
            )
            (event,) = [e for e in await admin.events(BUNDLE_EVENTS, since=since) if e.target == str(bundle)]
            assert (event.actor, event.outcome, event.reason) == (
                ADMIN_SPIFFE_ID,
                admin_pb2.AUDIT_OUTCOME_FAILED,
                common_pb2.ERROR_REASON_TRUST_BUNDLE_INVALID,
            )
            # The keys in force are unchanged: capabilities they signed still verify, fresh ones too.
            await asyncio.sleep(1.1)  # past the bundle's own change check on the request path
            assert await caller.bucket() == bucket
            assert await launchers.caller().remember("signed by a key still in force")

            # A good file again: the reload succeeds.
            shutil.copyfile(dev.trust_bundle, bundle)
            assert list((await admin.reload_bundle()).key_ids) == bundle_kids(dev.trust_bundle)
    finally:
        await launchers.aclose()


# --- ListAuditEvents ----------------------------------------------------------------------------


async def test_audit_events_page_two_at_a_time_newest_first_without_gaps(admin: AdminCalls) -> None:
    since = datetime.now(UTC) - timedelta(milliseconds=10)
    await bundle_reloads(admin, 5)
    everything = await admin.events(BUNDLE_EVENTS, since=since)
    assert len(everything) == 5

    pages: list[list[str]] = []
    token = ""
    while True:
        response = await admin.page(BUNDLE_EVENTS, page_size=2, page_token=token, since=since)
        pages.append([event.id for event in response.events])
        token = response.next_page_token
        if not token:
            break
        assert token.isdigit()
    assert [len(page) for page in pages] == [2, 2, 1]
    ids = [int(event_id) for page in pages for event_id in page]
    assert ids == sorted(ids, reverse=True)
    assert ids == [int(event.id) for event in everything]


async def test_audit_events_filter_by_kind(admin: AdminCalls, service: Service, dev: DevPaths) -> None:
    since = datetime.now(UTC) - timedelta(milliseconds=10)
    await bundle_reloads(admin, 2)
    assert len(await admin.events(BUNDLE_EVENTS, since=since)) == 2
    assert await admin.events(admin_pb2.AUDIT_EVENT_KIND_CREDENTIAL_ROTATION, since=since) == []
    both = await admin.events(BUNDLE_EVENTS, admin_pb2.AUDIT_EVENT_KIND_CAPABILITY_REVOCATION, since=since)
    assert {event.kind for event in both} == {BUNDLE_EVENTS}
    unfiltered = await admin.events(since=since)
    assert {event.id for event in both} <= {event.id for event in unfiltered}
    for event in await admin.events(BUNDLE_EVENTS):
        assert event.kind == BUNDLE_EVENTS


async def test_audit_events_filter_by_time_window(admin: AdminCalls) -> None:
    start = datetime.now(UTC) - timedelta(milliseconds=10)
    await bundle_reloads(admin, 2)
    await asyncio.sleep(0.05)
    middle = datetime.now(UTC)
    await asyncio.sleep(0.05)
    await bundle_reloads(admin, 3)

    first = await admin.events(BUNDLE_EVENTS, since=start, until=middle)
    second = await admin.events(BUNDLE_EVENTS, since=middle)
    assert (len(first), len(second)) == (2, 3)
    assert max(int(e.id) for e in first) < min(int(e.id) for e in second)
    for event in first:
        assert start <= event.occurred_at.ToDatetime(tzinfo=UTC) < middle
    for event in second:
        assert event.occurred_at.ToDatetime(tzinfo=UTC) >= middle
    assert await admin.events(BUNDLE_EVENTS, since=datetime.now(UTC) + timedelta(hours=1)) == []


@pytest.mark.parametrize(
    ("request_fields", "field"),
    [
        ({"page_token": "not-a-token"}, "page_token"),
        ({"page_token": "-5"}, "page_token"),
        ({"page_token": "9" * 25}, "page_token"),
        ({"page_size": -1}, "page_size"),
        ({"kinds": [admin_pb2.AUDIT_EVENT_KIND_UNSPECIFIED]}, "kinds[0]"),
        ({"kinds": [BUNDLE_EVENTS, 99]}, "kinds[1]"),
    ],
    ids=["word-token", "negative-token", "huge-token", "negative-size", "unspecified-kind", "unknown-kind"],
)
async def test_bad_audit_requests_are_invalid_argument_naming_the_field(
    admin: AdminCalls, request_fields: dict[str, Any], field: str
) -> None:
    refused = await failure(
        admin.stub.ListAuditEvents(admin_pb2.ListAuditEventsRequest(**request_fields), timeout=TIMEOUT)
    )
    assert (refused.code, refused.field_violations) == (grpc.StatusCode.INVALID_ARGUMENT, [field])


async def test_an_until_before_since_is_invalid_argument(admin: AdminCalls) -> None:
    now = datetime.now(UTC)
    refused = await failure(admin.page(since=now, until=now - timedelta(minutes=1)))
    assert (refused.code, refused.field_violations) == (grpc.StatusCode.INVALID_ARGUMENT, ["until"])


# --- no secrets ---------------------------------------------------------------------------------


async def test_no_secret_appears_in_any_audit_event_or_status(
    admin: AdminCalls, database: SharedDatabase, dev: DevPaths
) -> None:
    await admin.reload_bundle()
    secrets = [
        FileCredentialSource(directory).read().password
        for directory in (
            database.app_credential_dir,
            database.owner_credential_dir,
            database.rotator_credential_dir,
            database.superuser_credential_dir,
        )
    ]
    secrets += [path.read_text().strip() for path in dev.pepper_dir.iterdir() if path.is_file()]
    secrets.append(json.loads(dev.signing_key.read_text())["d"])
    assert all(len(secret) >= 16 for secret in secrets)

    status = await admin.status()
    assert status.active_role == FileCredentialSource(database.app_credential_dir).read().username
    assert status.pool_size >= 1
    assert status.pepper_versions
    events = await admin.events()
    assert events
    shown = [str(status), status.SerializeToString().decode("latin-1")]
    shown += [str(event) for event in events]
    shown += [event.SerializeToString().decode("latin-1") for event in events]
    text = "\n".join(shown)
    for secret in secrets:
        assert secret not in text


# --- roles --------------------------------------------------------------------------------------


@pytest.mark.parametrize("role", ["launcher", "control-plane"])
async def test_non_admin_callers_are_refused_every_admin_rpc(
    service: Service, dev: DevPaths, role: str
) -> None:
    calls = [
        (
            "RotateDatabaseCredentials",
            admin_pb2.RotateDatabaseCredentialsRequest(mode=admin_pb2.CREDENTIAL_ROTATION_MODE_ROTATE),
        ),
        ("GetCredentialStatus", admin_pb2.GetCredentialStatusRequest()),
        ("ReloadTrustBundle", admin_pb2.ReloadTrustBundleRequest()),
        ("ListAuditEvents", admin_pb2.ListAuditEventsRequest()),
    ]
    async with role_channel(service.port, dev, role) as channel:
        stub = admin_pb2_grpc.AdminServiceStub(channel)
        for method, request in calls:
            refused = await failure(getattr(stub, method)(request, timeout=TIMEOUT))
            assert (refused.code, refused.reason) == (
                grpc.StatusCode.PERMISSION_DENIED,
                "ROLE_NOT_ALLOWED",
            ), method


async def test_an_event_of_a_kind_this_version_does_not_know_is_listed_as_unspecified(
    admin: AdminCalls, database: SharedDatabase
) -> None:
    # A newer replica may record kinds this one does not know (a rolling upgrade): the listing
    # shows them as UNSPECIFIED instead of failing. (Outcomes have a CHECK constraint; a newer
    # migration widening it would be read the same way.)
    since = datetime.now(UTC) - timedelta(milliseconds=10)
    async with superuser(database) as conn:
        await conn.execute(
            "INSERT INTO audit_events (kind, actor, action, target, outcome, reason, detail) "
            "VALUES ('kind_from_the_future', 'spiffe://dev.local/x', 'a future action', '', "
            "'succeeded', 'REASON_FROM_THE_FUTURE', '')"
        )
    await bundle_reloads(admin, 1)
    listed = await admin.events(since=since)
    future = [event for event in listed if event.action == "a future action"]
    assert [(e.kind, e.outcome, e.reason) for e in future] == [
        (
            admin_pb2.AUDIT_EVENT_KIND_UNSPECIFIED,
            admin_pb2.AUDIT_OUTCOME_SUCCEEDED,
            common_pb2.ERROR_REASON_UNSPECIFIED,
        )
    ]
    assert any(event.kind == admin_pb2.AUDIT_EVENT_KIND_TRUST_BUNDLE_RELOAD for event in listed)
