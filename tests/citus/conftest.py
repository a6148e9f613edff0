"""The Citus integration suite: tokensvc's own tests, re-run against a real Citus coordinator.

Opt-in, because no registry this project installs from offers Citus. Set
`TOKENSVC_TEST_CITUS_DSN` to a superuser DSN (with its password) of a database on the coordinator
that has the `citus` and `vector` extensions and its workers added; the database is the suite's
own. The suite creates tokensvc's roles in the cluster (or gives them new passwords), makes the
schema owner own the database, and runs `migrate`, which distributes the schema. Unset, every test
here is skipped and the run ends with a banner saying that the suite did not run: a skip is never a
pass. docs/scaling.md, "Testing against Citus", says how to build a cluster to run it on.

The modules here import the tests they re-run, so one test body checks both engines; the session
fixture `database` below overrides the embedded one for them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import pytest

from tests.citus.cluster import prepare_citus_database
from tests.support import service_settings
from tokensvc.app import locate_database, migrate
from tokensvc.auth.devpki import ensure_dev_material
from tokensvc.storage.postgres import EmbeddedPaths, EmbeddedPostgresError

ENVIRONMENT = "TOKENSVC_TEST_CITUS_DSN"
_HERE = Path(__file__).parent
_NOT_RUN = (
    f"THE CITUS INTEGRATION SUITE DID NOT RUN: {ENVIRONMENT} is not set "
    "(docs/scaling.md, 'Testing against Citus')"
)


def citus_dsn() -> str | None:
    return os.environ.get(ENVIRONMENT) or None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if citus_dsn() is not None:
        return
    skip = pytest.mark.skip(reason=_NOT_RUN)
    for item in items:
        if _HERE in Path(item.path).parents:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    skipped = [
        report
        for report in terminalreporter.stats.get("skipped", [])
        if _HERE in Path(str(report.fspath)).resolve().parents
    ]
    if citus_dsn() is None and skipped:
        terminalreporter.write_sep("!", _NOT_RUN, red=True, bold=True)
        terminalreporter.write_line(f"{len(skipped)} Citus tests were skipped, not passed.", red=True)


@dataclass(frozen=True)
class CitusDatabase:
    """The coordinator, reached like the session's embedded database: DSN + credential dirs."""

    dsn: str
    paths: EmbeddedPaths

    @property
    def app_credential_dir(self) -> Path:
        return self.paths.credential_dir("app")

    @property
    def owner_credential_dir(self) -> Path:
        return self.paths.credential_dir("owner")

    @property
    def rotator_credential_dir(self) -> Path:
        return self.paths.credential_dir("rotator")

    @property
    def runner_credential_dir(self) -> Path:
        return self.paths.credential_dir("runner")

    @property
    def superuser_credential_dir(self) -> Path:
        return self.paths.credential_dir("superuser")


@pytest.fixture(scope="session")
async def database(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[CitusDatabase]:
    """The Citus coordinator named by TOKENSVC_TEST_CITUS_DSN, with tokensvc's roles, migrated."""
    given = citus_dsn()
    assert given is not None, "collected without the variable: the tests should have been skipped"
    root = Path(tempfile.mkdtemp(prefix="tokensvc-test-citus-"))
    paths = EmbeddedPaths(root)
    try:
        dsn = await prepare_citus_database(given, paths)
    except EmbeddedPostgresError as exc:
        raise pytest.UsageError(f"{ENVIRONMENT}: {exc}") from None
    citus = CitusDatabase(dsn, paths)
    settings = service_settings(citus, ensure_dev_material(tmp_path_factory.mktemp("citus-mig")), Path("."))  # type: ignore[arg-type]
    await migrate(await locate_database(settings), settings)
    await _cancel_leftover_migrations(given)
    yield citus
    shutil.rmtree(root, ignore_errors=True)


async def _cancel_leftover_migrations(superuser_dsn: str) -> None:
    """The database outlives a run: migrations an interrupted run left unfinished are cancelled
    (the runners clear their slots), so this run's runners are not busy with them first."""
    conn = await asyncpg.connect(superuser_dsn)
    try:
        await conn.execute(
            "UPDATE tokensvc.embedding_migrations SET state = 'cancelling', lease_owner = NULL, "
            "lease_until = NULL, cursor_bucket = NULL, cursor_id = NULL, cursor_document = NULL "
            "WHERE state IN ('backfilling', 'paused')"
        )
    finally:
        await conn.close()
