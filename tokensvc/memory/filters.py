"""The metadata filter language: the tree of `tokensvc.storage.filters` (whose docstring states
the semantics), as the domain names it.

The API edge decodes the proto's `Filter` into this tree (`tokensvc.api.filter_codec`); every
store applies it with exactly those semantics, and `matches` evaluates it in Python.
"""

from __future__ import annotations

from tokensvc.storage.filters import (
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
    "Not",
    "Operator",
    "matches",
]
