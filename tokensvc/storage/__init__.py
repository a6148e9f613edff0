"""Storage: the store ports (Protocols with their contracts) and the records they speak.

Implementations: `tokensvc.storage.postgres` (every SQL statement) and `tokensvc.storage.inprocess`
(in-process); `tokensvc.storage.secrets` reads and writes credentials in mounted secret files.
Nothing here imports the domain (`memory/`, `knowledge/`, `credentials/`) or the API.
"""

from tokensvc.storage.ports import (
    AuditStore,
    ConnectionPool,
    CredentialJournal,
    CredentialSource,
    DatabaseHealth,
    DatabaseLogins,
    DatabaseServer,
    EmbeddingMigrationStore,
    KnowledgeBackfillStore,
    KnowledgeStore,
    MemoryBackfillStore,
    MemoryStatistics,
    MemoryStore,
    MigrationOperationsStore,
    MigrationRunnerStore,
    MigrationStateStore,
    RevocationStore,
)

__all__ = [
    "AuditStore",
    "ConnectionPool",
    "CredentialJournal",
    "CredentialSource",
    "DatabaseHealth",
    "DatabaseLogins",
    "DatabaseServer",
    "EmbeddingMigrationStore",
    "KnowledgeBackfillStore",
    "KnowledgeStore",
    "MemoryBackfillStore",
    "MemoryStatistics",
    "MemoryStore",
    "MigrationOperationsStore",
    "MigrationRunnerStore",
    "MigrationStateStore",
    "RevocationStore",
]
