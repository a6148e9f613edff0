"""Long-term memory: the domain logic behind MemoryService (metadata, filters, the service)."""

from __future__ import annotations

from tokensvc.memory.filters import AllOf, AnyOf, Condition, Filter, Not, Operator, matches
from tokensvc.memory.metadata import MetadataScalar, metadata_from_json

__all__ = [
    "AllOf",
    "AnyOf",
    "Condition",
    "Filter",
    "MetadataScalar",
    "Not",
    "Operator",
    "matches",
    "metadata_from_json",
]
