"""The metadata filter language: its tree, its semantics and the Python evaluator.

A filter is a small immutable tree: `Condition` leaves combined by `AllOf`, `AnyOf` and `Not`,
built from the proto at the API edge (`filter_from_proto`). Every store applies it with exactly
these semantics: `matches` here (the in-process stores), `compile_filter` in
`tokensvc.storage.postgres.filter_sql` (SQL); a property test checks the two agree.

Semantics:

- values have a kind: string, number or boolean. Values of different kinds are never equal and
  never ordered, so such a comparison is false, not an error; `true` is not `1`;
- numbers compare as numbers (`10 > 9`), strings by Unicode code point, which is the byte order of
  their UTF-8 and what PostgreSQL's `COLLATE "C"` does (`"10" < "9"`); booleans only EQ/NE/IN/NIN;
- every comparison against a missing key is false, including NE and NIN; EXISTS is presence;
- NE matches a present value of the same kind that differs; NIN matches a present value equal to
  none of the values, whatever its kind (the proto's wording: "equals none of `values`");
- IN/NIN lists may mix kinds; each element is compared with its own kind;
- `Not` is plain negation of the two-valued result, so `Not(<condition on a missing key>)` is
  true: wrap EQ or IN in `Not` to also match documents without the key;
- `-0.0` equals `0.0` (numbers compare numerically, and jsonb has no negative zero).
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

__all__ = [
    "COMPARISONS",
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
    "operand",
    "scalar_kind",
]

MetadataScalar = str | float | bool
"""One metadata value. Check `bool` before `float`: in Python `True == 1`, here they never meet."""


def scalar_kind(value: MetadataScalar) -> str:
    """The JSON type name of a scalar, as `jsonb_typeof` spells it: string, number or boolean."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, str):
        return "string"
    return "number"


class Operator(enum.StrEnum):
    EQ = "eq"
    NE = "ne"
    IN = "in"
    NIN = "nin"
    GT = "gt"
    GTE = "gte"
    LT = "lt"
    LTE = "lte"
    EXISTS = "exists"


# Operators that compare `value` with the stored value of the same kind: SQL symbol, Python test.
COMPARISONS: dict[Operator, tuple[str, Callable[[Any, Any], bool]]] = {
    Operator.EQ: ("=", operator.eq),
    Operator.NE: ("<>", operator.ne),
    Operator.GT: (">", operator.gt),
    Operator.GTE: (">=", operator.ge),
    Operator.LT: ("<", operator.lt),
    Operator.LTE: ("<=", operator.le),
}
ORDERING_OPERATORS = frozenset({Operator.GT, Operator.GTE, Operator.LT, Operator.LTE})
LIST_OPERATORS = frozenset({Operator.IN, Operator.NIN})


@dataclass(frozen=True)
class Condition:
    """A leaf: `value` for EQ, NE and the orderings; `values` for IN and NIN; neither for EXISTS."""

    key: str
    op: Operator
    value: MetadataScalar | None = None
    values: tuple[MetadataScalar, ...] = ()


@dataclass(frozen=True)
class AllOf:
    """Matches when every filter matches (an empty list matches everything)."""

    filters: tuple[Filter, ...]


@dataclass(frozen=True)
class AnyOf:
    """Matches when at least one filter matches (an empty list matches nothing)."""

    filters: tuple[Filter, ...]


@dataclass(frozen=True)
class Not:
    """Matches when `filter` does not match."""

    filter: Filter


Filter: TypeAlias = Condition | AllOf | AnyOf | Not


# --- Python -----------------------------------------------------------------------------------


def matches(filter: Filter, metadata: Mapping[str, MetadataScalar]) -> bool:
    """Evaluate `filter` on one metadata map with exactly the semantics of `compile_filter`."""
    if isinstance(filter, Condition):
        return _condition_matches(filter, metadata)
    if isinstance(filter, Not):
        return not matches(filter.filter, metadata)
    if isinstance(filter, AllOf):
        return all(matches(child, metadata) for child in filter.filters)
    return any(matches(child, metadata) for child in filter.filters)


def _equal(a: MetadataScalar, b: MetadataScalar) -> bool:
    # Kinds first: in Python `True == 1` and `1.0 == True`, which must never hold here.
    return scalar_kind(a) == scalar_kind(b) and a == b


def _condition_matches(cond: Condition, metadata: Mapping[str, MetadataScalar]) -> bool:
    if cond.key not in metadata:
        return False
    actual = metadata[cond.key]
    op = cond.op
    if op is Operator.EXISTS:
        return True
    if op in LIST_OPERATORS:
        found = any(_equal(actual, value) for value in cond.values)
        return found if op is Operator.IN else not found
    value = operand(cond)
    kind = scalar_kind(value)
    if scalar_kind(actual) != kind or (kind == "boolean" and op in ORDERING_OPERATORS):
        return False
    # Python orders str by code point, the UTF-8 byte order of PostgreSQL's "C" collation.
    return COMPARISONS[op][1](actual, value)


def operand(cond: Condition) -> MetadataScalar:
    if cond.value is None:
        raise ValueError(f"{cond.op.name} condition on {cond.key!r} has no value")
    return cond.value
