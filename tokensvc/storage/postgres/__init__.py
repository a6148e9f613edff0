"""The PostgreSQL + pgvector implementation of every store port, its pool, migrations and the
embedded server. All of tokensvc's SQL lives under this package, and database failures become
domain errors here (`errors.py`), so nothing above storage imports asyncpg."""

from tokensvc.storage.postgres.audit import PostgresAuditStore
from tokensvc.storage.postgres.citus import PLACEMENTS, citus_version
from tokensvc.storage.postgres.data_subjects import PostgresDataSubjectStore
from tokensvc.storage.postgres.database import Database, DatabaseLocation, DatabaseTarget, connect_once
from tokensvc.storage.postgres.embedded import (
    EmbeddedPaths,
    EmbeddedPostgres,
    EmbeddedPostgresError,
    ensure_roles,
)
from tokensvc.storage.postgres.ingestion import PostgresIngestionStore
from tokensvc.storage.postgres.knowledge import PostgresKnowledgeStore
from tokensvc.storage.postgres.logins import PostgresLogins
from tokensvc.storage.postgres.memories import PostgresMemoryStore
from tokensvc.storage.postgres.monitoring import PostgresHealth, PostgresStatistics
from tokensvc.storage.postgres.reembedding import PostgresEmbeddingMigrationStore
from tokensvc.storage.postgres.revocations import PostgresRevocationStore
from tokensvc.storage.postgres.rotations import PostgresRotationJournal
from tokensvc.storage.postgres.schema_migrations import (
    SchemaMigrationError,
    apply_schema_migrations,
    available_schema_migrations,
    schema_version,
)
from tokensvc.storage.postgres.vector_indexes import PostgresVectorIndexes

__all__ = [
    "PLACEMENTS",
    "Database",
    "DatabaseLocation",
    "DatabaseTarget",
    "EmbeddedPaths",
    "EmbeddedPostgres",
    "EmbeddedPostgresError",
    "PostgresAuditStore",
    "PostgresDataSubjectStore",
    "PostgresEmbeddingMigrationStore",
    "PostgresHealth",
    "PostgresIngestionStore",
    "PostgresKnowledgeStore",
    "PostgresLogins",
    "PostgresMemoryStore",
    "PostgresRevocationStore",
    "PostgresRotationJournal",
    "PostgresStatistics",
    "PostgresVectorIndexes",
    "SchemaMigrationError",
    "apply_schema_migrations",
    "available_schema_migrations",
    "citus_version",
    "connect_once",
    "ensure_roles",
    "schema_version",
]
