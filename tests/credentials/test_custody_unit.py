"""CredentialCustodian's rules that need no database, on the in-process secret source and audit
trail: new connections get the last tested credential whatever the secret holds now, a custodian
cannot start on a secret it cannot read, login roles are plain identifiers, and ROTATE without a
rotator credential is refused and audited before anything is journaled.

The custodian's `DatabaseLogins` is the real PostgreSQL adapter aimed at a port nothing listens on
(there is no in-process stand-in for login roles): none of these paths may reach the database, and
one that did would fail DATABASE_UNAVAILABLE. Rotations, reloads and recovery against real roles
are tests/credentials/test_rotation.py and test_rotation_crash.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import free_port
from tokensvc.audit import AuditKind, AuditLog, AuditOutcome
from tokensvc.credentials import CredentialCustodian
from tokensvc.errors import Reason, TokensvcError
from tokensvc.storage.inprocess import InProcessAuditStore, InProcessCredentialSource
from tokensvc.storage.postgres import DatabaseTarget, PostgresLogins
from tokensvc.storage.records import DatabaseCredential
from tokensvc.storage.secrets import FileCredentialSource

ROLES = ("tokensvc_app_a", "tokensvc_app_b")
FIRST = DatabaseCredential("tokensvc_app_a", "the-first-password")


def unreachable_logins(tmp_path: Path) -> PostgresLogins:
    return PostgresLogins(
        DatabaseTarget(
            host="127.0.0.1",
            port=free_port(),
            database="tokensvc",
            app_credentials=FileCredentialSource(tmp_path / "unused"),
            owner_credentials=None,
            connect_timeout=0.5,
        )
    )


def custodian(
    tmp_path: Path, source: InProcessCredentialSource, audit: AuditLog | None = None
) -> CredentialCustodian:
    return CredentialCustodian(
        source=source, rotator=None, login_roles=ROLES, logins=unreachable_logins(tmp_path), audit=audit
    )


def test_new_connections_keep_the_tested_credential_when_the_secret_changes_or_breaks(
    tmp_path: Path,
) -> None:
    source = InProcessCredentialSource(FIRST)
    custody = custodian(tmp_path, source)
    assert (custody.credential_for_new_connection(), custody.active_role) == (FIRST, "tokensvc_app_a")

    source.write(DatabaseCredential("tokensvc_app_b", "not-tested-yet"))
    assert custody.credential_for_new_connection() == FIRST  # adopted only after a login test

    source.write(DatabaseCredential("tokensvc_app_b", ""))
    assert custody.credential_for_new_connection() == FIRST  # a broken secret never breaks serving
    assert custody.active_role == "tokensvc_app_a"


@pytest.mark.parametrize(
    "credential", [None, DatabaseCredential("", "a-password"), DatabaseCredential("tokensvc_app_a", "\n")]
)
def test_a_custodian_cannot_start_on_a_secret_it_cannot_read(
    tmp_path: Path, credential: DatabaseCredential | None
) -> None:
    with pytest.raises(TokensvcError) as refused:
        custodian(tmp_path, InProcessCredentialSource(credential))
    assert refused.value.reason is Reason.CREDENTIAL_INVALID


@pytest.mark.parametrize("role", ["", "Tokensvc_App", "app; DROP ROLE admin", 'app"b'])
def test_login_roles_must_be_plain_sql_identifiers(tmp_path: Path, role: str) -> None:
    with pytest.raises(ValueError, match="plain SQL identifier"):
        CredentialCustodian(
            source=InProcessCredentialSource(FIRST),
            rotator=None,
            login_roles=("tokensvc_app_a", role),
            logins=unreachable_logins(tmp_path),
        )


async def test_rotate_without_a_rotator_is_refused_and_audited_before_anything_changes(
    tmp_path: Path,
) -> None:
    source, events = InProcessCredentialSource(FIRST), InProcessAuditStore()
    # Not attached to a journal: journaling anything would raise RuntimeError.
    custody = custodian(tmp_path, source, AuditLog(events))
    stamp = source.stamp()

    with pytest.raises(TokensvcError) as refused:
        await custody.rotate("spiffe://dev.test/admin")

    assert refused.value.reason is Reason.ROTATION_FAILED
    assert "database_rotator_credential_dir" in refused.value.message
    [event] = await events.page(before_id=None, kinds=(), since=None, until=None, limit=10)
    assert (event.kind, event.actor, event.outcome, event.reason) == (
        AuditKind.CREDENTIAL_ROTATION.value,
        "spiffe://dev.test/admin",
        AuditOutcome.FAILED.value,
        Reason.ROTATION_FAILED.value,
    )
    assert source.stamp() == stamp  # the secret was not rewritten
    assert custody.credential_for_new_connection() == FIRST
