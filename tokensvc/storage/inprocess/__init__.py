"""In-process implementations of every store port: no database, the same contracts.

The store ports are the memories, their statistics, re-embedding migrations and end-user data
requests, the knowledge bases and their background ingestion, revocations, the audit trail, the
credential journal and the credential source; the ports that adapt the database server itself
(`DatabaseLogins`, `ConnectionPool`, `DatabaseHealth`, `DatabaseServer`) have none.

Each passes the conformance suite (`tests/storage/conformance/`) that the PostgreSQL stores pass;
domain unit tests run on them. Differences that the contracts leave open, and that are documented
in the modules: searches are always exact (`CandidateQuery.exact` is ignored), text is split into
`simple` words whatever the pinned text-search configuration (no stemming, no stop words:
`tokensvc.storage.inprocess.text`), nothing is durable, and a write outside the tenant's buckets or
roster raises `PermissionError` where PostgreSQL's row-level security refuses it.
"""

from tokensvc.storage.inprocess.clock import Clock
from tokensvc.storage.inprocess.credentials import InProcessCredentialJournal, InProcessCredentialSource
from tokensvc.storage.inprocess.data_subjects import InProcessDataSubjectStore
from tokensvc.storage.inprocess.ingestion import InProcessIngestionStore
from tokensvc.storage.inprocess.knowledge import InProcessKnowledgeStore
from tokensvc.storage.inprocess.ledgers import InProcessAuditStore, InProcessRevocationStore
from tokensvc.storage.inprocess.memories import InProcessMemoryStatistics, InProcessMemoryStore
from tokensvc.storage.inprocess.reembedding import InProcessEmbeddingMigrationStore

__all__ = [
    "Clock",
    "InProcessAuditStore",
    "InProcessCredentialJournal",
    "InProcessCredentialSource",
    "InProcessDataSubjectStore",
    "InProcessEmbeddingMigrationStore",
    "InProcessIngestionStore",
    "InProcessKnowledgeStore",
    "InProcessMemoryStatistics",
    "InProcessMemoryStore",
    "InProcessRevocationStore",
]
