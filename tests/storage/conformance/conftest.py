"""The conformance suite's fixtures: every test runs once per store implementation.

`backend` is parametrized over PostgreSQL (the session's real embedded database, reached through a
pool of the serving role, opened the way the service opens it) and the in-process stores (fresh
per test, no database: `pytest tests/storage/conformance -k inprocess` starts none). PostgreSQL's
database is shared by the whole session, so a test works in fresh buckets, agents and namespaces
and never assumes an empty table. Two exceptions: the rotation journal (one global table, no
tenant) runs on a database of its own, emptied before each test; the credential source runs over
files in a temporary directory (`file`) and in process (`inprocess`), no database either way.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import numpy as np
import pytest

from tests.storage.conformance.support import create_base, management, new_bucket, new_namespace, new_tenant
from tests.support import SharedDatabase, service_settings
from tokensvc.app import locate_database
from tokensvc.auth.devpki import DevPaths
from tokensvc.storage.inprocess import (
    InProcessAuditStore,
    InProcessCredentialJournal,
    InProcessCredentialSource,
    InProcessDataSubjectStore,
    InProcessEmbeddingMigrationStore,
    InProcessIngestionStore,
    InProcessKnowledgeStore,
    InProcessMemoryStatistics,
    InProcessMemoryStore,
    InProcessRevocationStore,
)
from tokensvc.storage.ports import (
    AuditStore,
    CredentialJournal,
    CredentialSource,
    DataSubjectStore,
    EmbeddingMigrationStore,
    IngestionStore,
    KnowledgeStore,
    MemoryStatistics,
    MemoryStore,
    RevocationStore,
)
from tokensvc.storage.postgres import (
    Database,
    PostgresAuditStore,
    PostgresDataSubjectStore,
    PostgresEmbeddingMigrationStore,
    PostgresIngestionStore,
    PostgresKnowledgeStore,
    PostgresMemoryStore,
    PostgresRevocationStore,
    PostgresRotationJournal,
    PostgresStatistics,
)
from tokensvc.storage.records import Tenant
from tokensvc.storage.secrets import FileCredentialSource

BACKENDS = ("postgres", "inprocess")


@dataclass(frozen=True)
class Backend:
    """One implementation of every store port."""

    name: str
    memories: MemoryStore
    knowledge: KnowledgeStore
    revocations: RevocationStore
    audit: AuditStore
    statistics: MemoryStatistics  # counts over `memories`' rows
    migrations: EmbeddingMigrationStore  # over `memories`' rows
    data_subjects: DataSubjectStore  # over `memories`' rows
    ingestion: IngestionStore  # over `knowledge`'s tables


@pytest.fixture(scope="session")
async def conformance_database(
    database: SharedDatabase, dev: DevPaths, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Database]:
    """The shared database as the service reaches it: the serving pool, the re-embedding runner's
    pool, and connections of their own."""
    db = await locate_database(service_settings(database, dev, tmp_path_factory.mktemp("conformance")))
    try:
        await db.open_pool()
        source = db.target.runner_credentials
        assert source is not None
        await db.open_runner_pool(source.read, 4)
        yield db
    finally:
        await db.close()


@pytest.fixture(scope="session")
def conformance_pool(conformance_database: Database) -> asyncpg.Pool:
    return conformance_database.pool


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Backend:
    if request.param == "postgres":
        # Asked for here, not as a parameter: the in-process runs need no database at all.
        db: Database = request.getfixturevalue("conformance_database")
        pool = db.pool
        return Backend(
            "postgres",
            PostgresMemoryStore(pool),
            PostgresKnowledgeStore(pool),
            PostgresRevocationStore(pool, db.connect),
            PostgresAuditStore(pool),
            PostgresStatistics(pool),
            PostgresEmbeddingMigrationStore(pool, runner_pool=db.runner_pool),
            PostgresDataSubjectStore(pool),
            PostgresIngestionStore(pool, db.runner_pool),
        )
    memories = InProcessMemoryStore()
    knowledge = InProcessKnowledgeStore()
    audit = InProcessAuditStore()
    return Backend(
        "inprocess",
        memories,
        knowledge,
        InProcessRevocationStore(),
        audit,
        InProcessMemoryStatistics(memories),
        InProcessEmbeddingMigrationStore(memories, audit, knowledge),
        InProcessDataSubjectStore(memories),
        InProcessIngestionStore(knowledge.tables),
    )


@pytest.fixture
async def kb_namespace(backend: Backend) -> AsyncIterator[str]:
    """A fresh namespace with the knowledge base "kb"; its bases (their documents and ingestions)
    are deleted when the test ends, so PostgreSQL's shared queue does not keep them."""
    namespace = new_namespace()
    await create_base(backend.knowledge, namespace, "kb")
    yield namespace
    for base in await backend.knowledge.list_bases(management(namespace), after=None, limit=100):
        await backend.knowledge.delete_base(management(namespace), base.ref)


@pytest.fixture
def memories(backend: Backend) -> MemoryStore:
    return backend.memories


@pytest.fixture
def knowledge(backend: Backend) -> KnowledgeStore:
    return backend.knowledge


@pytest.fixture
def statistics(backend: Backend) -> MemoryStatistics:
    return backend.statistics


@pytest.fixture
def migrations(backend: Backend) -> EmbeddingMigrationStore:
    return backend.migrations


@dataclass(frozen=True)
class JournalDatabase:
    """A migrated database of the shared server for the rotation journal alone."""

    pool: asyncpg.Pool  # the serving role's, opened the way the service opens it
    owner: asyncpg.Connection  # the schema owner's, to empty the journal between tests


async def _connect(dsn: str, directory: Path) -> asyncpg.Connection:
    credential = FileCredentialSource(directory).read()
    return await asyncpg.connect(dsn, user=credential.username, password=credential.password)


@pytest.fixture(scope="session")
async def journal_database(
    database: SharedDatabase, dev: DevPaths, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[JournalDatabase]:
    """The journal's table has no tenant: in the shared database it holds every other test's
    rotations (and its current version is theirs). Here each test starts from an empty journal."""
    server, name = database.dsn.rsplit("/", 1)[0], f"journal_{uuid.uuid4().hex[:10]}"
    owner_name = FileCredentialSource(database.owner_credential_dir).read().username
    admin = await _connect(f"{server}/postgres", database.superuser_credential_dir)
    await admin.execute(f"CREATE DATABASE {name} OWNER {owner_name}")
    try:
        extension = await _connect(f"{server}/{name}", database.superuser_credential_dir)
        await extension.execute("CREATE EXTENSION vector")
        await extension.close()
        settings = service_settings(
            database, dev, tmp_path_factory.mktemp("journal"), database_dsn=f"{server}/{name}"
        )
        db = await locate_database(settings)
        await db.migrate(settings.database_app_role, settings.database_runner_role)
        owner = await _connect(f"{server}/{name}", database.owner_credential_dir)
        try:
            yield JournalDatabase(await db.open_pool(), owner)
        finally:
            await owner.close()
            await db.close()
    finally:
        await admin.execute(f"DROP DATABASE {name} WITH (FORCE)")
        await admin.close()


@pytest.fixture
async def empty_journal_database(journal_database: JournalDatabase) -> JournalDatabase:
    await journal_database.owner.execute("TRUNCATE tokensvc.credential_rotations RESTART IDENTITY")
    return journal_database


@pytest.fixture(params=BACKENDS)
def journal(request: pytest.FixtureRequest) -> CredentialJournal:
    """An empty rotation journal."""
    if request.param == "postgres":
        journal_db: JournalDatabase = request.getfixturevalue("empty_journal_database")
        return PostgresRotationJournal(journal_db.pool)
    return InProcessCredentialJournal()


class Secret:
    """One secret, and handles on it: `open()` gives another reader and writer of the same secret
    (for files, another `FileCredentialSource` over the directory; in process, the one source)."""

    def __init__(self, name: str, tmp_path: Path):
        self.name = name
        self._directory = tmp_path / "secret"
        self._inprocess = InProcessCredentialSource()

    def open(self) -> CredentialSource:
        return FileCredentialSource(self._directory) if self.name == "file" else self._inprocess


@pytest.fixture(params=("file", "inprocess"))
def secret(request: pytest.FixtureRequest, tmp_path: Path) -> Secret:
    """A secret nothing has been written to yet."""
    return Secret(request.param, tmp_path)


@pytest.fixture
def bucket() -> str:
    return new_bucket()


@pytest.fixture
def tenant(bucket: str) -> Tenant:
    return new_tenant(bucket)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20240604)
