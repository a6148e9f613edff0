"""Storage: the store ports (Protocols with their contracts) and the records they speak.

Implementations: `tokensvc.storage.postgres` (every SQL statement) and `tokensvc.storage.memory`
(in-process). Nothing here imports the domain (`memory/`, `knowledge/`) or the API.
"""

from tokensvc.storage.ports import AuditStore, KnowledgeStore, MemoryStore, RevocationStore

__all__ = ["AuditStore", "KnowledgeStore", "MemoryStore", "RevocationStore"]
