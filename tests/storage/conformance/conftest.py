"""The conformance suite's fixtures: every test runs once per store implementation.

`backend` is parametrized over PostgreSQL (the session's real embedded database, reached through a
pool of the serving role, opened the way the service opens it) and the in-memory stores (fresh
per test, no database: `pytest tests/storage/conformance -k inmemory` starts none). PostgreSQL's
database is shared by the whole session, so a test works in fresh buckets, agents and namespaces
and never assumes an empty table.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import asyncpg
import numpy as np
import pytest

from tests.storage.conformance.support import new_bucket, new_tenant
from tests.support import SharedDatabase, service_settings
from tokensvc.auth.devpki import DevPaths
from tokensvc.storage.memory import (
    InMemoryAuditStore,
    InMemoryKnowledgeStore,
    InMemoryMemoryStore,
    InMemoryRevocationStore,
)
from tokensvc.storage.ports import AuditStore, KnowledgeStore, MemoryStore, RevocationStore
from tokensvc.storage.postgres import (
    Database,
    PostgresAuditStore,
    PostgresKnowledgeStore,
    PostgresMemoryStore,
    PostgresRevocationStore,
)
from tokensvc.storage.records import Tenant

BACKENDS = ("postgres", "inmemory")


@dataclass(frozen=True)
class Backend:
    """One implementation of every store port."""

    name: str
    memories: MemoryStore
    knowledge: KnowledgeStore
    revocations: RevocationStore
    audit: AuditStore


@pytest.fixture(scope="session")
async def conformance_pool(
    database: SharedDatabase, dev: DevPaths, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[asyncpg.Pool]:
    db = await Database.locate(service_settings(database, dev, tmp_path_factory.mktemp("conformance")))
    try:
        yield await db.open_pool()
    finally:
        await db.close()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Backend:
    if request.param == "postgres":
        # Asked for here, not as a parameter: the in-memory runs need no database at all.
        pool: asyncpg.Pool = request.getfixturevalue("conformance_pool")
        return Backend(
            "postgres",
            PostgresMemoryStore(pool),
            PostgresKnowledgeStore(pool),
            PostgresRevocationStore(pool),
            PostgresAuditStore(pool),
        )
    return Backend(
        "inmemory",
        InMemoryMemoryStore(),
        InMemoryKnowledgeStore(),
        InMemoryRevocationStore(),
        InMemoryAuditStore(),
    )


@pytest.fixture
def memories(backend: Backend) -> MemoryStore:
    return backend.memories


@pytest.fixture
def knowledge(backend: Backend) -> KnowledgeStore:
    return backend.knowledge


@pytest.fixture
def bucket() -> str:
    return new_bucket()


@pytest.fixture
def tenant(bucket: str) -> Tenant:
    return new_tenant(bucket)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20240604)
