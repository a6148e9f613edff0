"""Long-term memory: the domain logic behind MemoryService (metadata, filters, the service).

The metadata filter language is re-exported here as the domain names it: the tree of
`tokensvc.storage.filter_language` (whose docstring states the semantics). The API edge decodes
the proto's `Filter` into this tree (`tokensvc.api.filter_codec`); every store applies it with
exactly those semantics, and `matches` evaluates it in Python.
"""

from __future__ import annotations

from tokensvc.memory.metadata import MetadataScalar, metadata_from_json
from tokensvc.storage.filter_language import (
    LIST_OPERATORS,
    ORDERING_OPERATORS,
    AllOf,
    AnyOf,
    Condition,
    Filter,
    Not,
    Operator,
    matches,
)

__all__ = [
    "LIST_OPERATORS",
    "ORDERING_OPERATORS",
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
