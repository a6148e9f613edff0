"""Storage: the database pool, the embedded PostgreSQL and migrations."""

from tokensvc.storage.database import Database, DatabaseTarget, connect_once
from tokensvc.storage.embedded import EmbeddedPostgres, EmbeddedPostgresError
from tokensvc.storage.migrations import (
    MigrationError,
    apply_migrations,
    available_migrations,
    schema_version,
)

__all__ = [
    "Database",
    "DatabaseTarget",
    "EmbeddedPostgres",
    "EmbeddedPostgresError",
    "MigrationError",
    "apply_migrations",
    "available_migrations",
    "connect_once",
    "schema_version",
]
