"""Long-term memory's domain records (frozen; no I/O): the store port's records."""

from __future__ import annotations

from tokensvc.storage.records import MemoryRecord, MemorySpace, NewMemory, StoredRef

__all__ = ["MemoryRecord", "MemorySpace", "NewMemory", "StoredRef"]
