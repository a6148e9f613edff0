"""The metadata filter language: validation from the proto, SQL compilation and a Python evaluator.

A filter is a small immutable tree: `Condition` leaves combined by `AllOf`, `AnyOf` and `Not`. The
API edge builds it with `filter_from_proto`, which enforces the contract written in
`protos/tokensvc/v1/common.proto` (`Filter`, `FieldFilter`, `FilterOperator`) and names the
offending node in every error. An unset filter field means "no filter": callers check
`request.HasField("filter")` and pass `None` down instead of calling `filter_from_proto`.

Semantics (identical in `compile_filter` and `matches`; a property test checks they agree):

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
import json
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

from tokensvc.errors import InvalidArgument
from tokensvc.memory.metadata import (
    MAX_METADATA_KEY_CHARS,
    MetadataScalar,
    is_valid_key,
    scalar_from_proto,
    scalar_kind,
)
from tokensvc.v1 import common_pb2

__all__ = [
    "MAX_FILTER_DEPTH",
    "MAX_FILTER_NODES",
    "MAX_FILTER_VALUES",
    "AllOf",
    "AnyOf",
    "Condition",
    "Filter",
    "Not",
    "Operator",
    "compile_filter",
    "filter_from_proto",
    "matches",
]

MAX_FILTER_DEPTH = 8
"""Levels of nesting: a lone condition is 1 level, an `and` of conditions 2."""
MAX_FILTER_NODES = 64
"""`Filter` messages in total (a leaf counts once, with its `FieldFilter`)."""
MAX_FILTER_VALUES = 100
"""Values of one IN or NIN."""


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


_OPERATORS: dict[int, Operator] = {
    common_pb2.FILTER_OPERATOR_EQ: Operator.EQ,
    common_pb2.FILTER_OPERATOR_NE: Operator.NE,
    common_pb2.FILTER_OPERATOR_IN: Operator.IN,
    common_pb2.FILTER_OPERATOR_NIN: Operator.NIN,
    common_pb2.FILTER_OPERATOR_GT: Operator.GT,
    common_pb2.FILTER_OPERATOR_GTE: Operator.GTE,
    common_pb2.FILTER_OPERATOR_LT: Operator.LT,
    common_pb2.FILTER_OPERATOR_LTE: Operator.LTE,
    common_pb2.FILTER_OPERATOR_EXISTS: Operator.EXISTS,
}
# Operators that compare `value` with the stored value of the same kind: SQL symbol, Python test.
_COMPARISONS: dict[Operator, tuple[str, Callable[[Any, Any], bool]]] = {
    Operator.EQ: ("=", operator.eq),
    Operator.NE: ("<>", operator.ne),
    Operator.GT: (">", operator.gt),
    Operator.GTE: (">=", operator.ge),
    Operator.LT: ("<", operator.lt),
    Operator.LTE: ("<=", operator.le),
}
_ORDERING = frozenset({Operator.GT, Operator.GTE, Operator.LT, Operator.LTE})
_LISTS = frozenset({Operator.IN, Operator.NIN})


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


# --- from the proto ---------------------------------------------------------------------------


def filter_from_proto(message: common_pb2.Filter, field: str = "filter") -> Filter:
    """Validate a present `Filter` message and return its tree; `field` is the message's path.

    Raises `InvalidArgument` naming the offending node, e.g.
    `filter.and_filters.filters[1].field.value`. The size limits are checked first by an
    iterative walk that stops at the first node past them, so neither a deeply nested nor a very
    wide filter costs more than the limits allow; the tree is then built by recursion at most
    `MAX_FILTER_DEPTH` deep.
    """
    _check_limits(message, field)
    return _node(message, field)


def _check_limits(message: common_pb2.Filter, field: str) -> None:
    stack: list[tuple[common_pb2.Filter, str, int]] = [(message, field, 1)]
    seen = 0
    while stack:
        node, path, depth = stack.pop()
        seen += 1
        if depth > MAX_FILTER_DEPTH:
            raise InvalidArgument(path, f"filter nests deeper than {MAX_FILTER_DEPTH} levels")
        if seen > MAX_FILTER_NODES:
            raise InvalidArgument(path, f"filter has more than {MAX_FILTER_NODES} nodes")
        kind = node.WhichOneof("node")
        if kind == "not_filter":
            stack.append((node.not_filter, f"{path}.not_filter", depth + 1))
        elif kind in {"and_filters", "or_filters"}:
            children = node.and_filters.filters if kind == "and_filters" else node.or_filters.filters
            # Beyond MAX_FILTER_NODES children the count overflows before the walk gets there.
            for index in reversed(range(min(len(children), MAX_FILTER_NODES))):
                stack.append((children[index], f"{path}.{kind}.filters[{index}]", depth + 1))


def _node(message: common_pb2.Filter, path: str) -> Filter:
    kind = message.WhichOneof("node")
    if kind == "field":
        return _condition(message.field, f"{path}.field")
    if kind == "not_filter":
        return Not(_node(message.not_filter, f"{path}.not_filter"))
    if kind in {"and_filters", "or_filters"}:
        children = message.and_filters.filters if kind == "and_filters" else message.or_filters.filters
        if not children:
            raise InvalidArgument(f"{path}.{kind}.filters", "at least one filter is required")
        nodes = tuple(_node(child, f"{path}.{kind}.filters[{i}]") for i, child in enumerate(children))
        return AllOf(nodes) if kind == "and_filters" else AnyOf(nodes)
    raise InvalidArgument(path, "exactly one of field, and_filters, or_filters or not_filter must be set")


def _condition(message: common_pb2.FieldFilter, path: str) -> Condition:
    if not is_valid_key(message.key):
        raise InvalidArgument(
            f"{path}.key", f"key must be 1 to {MAX_METADATA_KEY_CHARS} characters from A-Z a-z 0-9 _ - ."
        )
    op = _OPERATORS.get(message.operator)
    if op is None:
        what = "is required" if message.operator == 0 else f"{message.operator} is not a known operator"
        raise InvalidArgument(f"{path}.operator", f"operator {what}")
    has_value = message.HasField("value")
    if op in _LISTS:
        if has_value:
            raise InvalidArgument(f"{path}.value", f"{op.name} takes `values`, not `value`")
        count = len(message.values)
        if not 1 <= count <= MAX_FILTER_VALUES:
            raise InvalidArgument(f"{path}.values", f"{op.name} takes 1 to {MAX_FILTER_VALUES} values")
        values = tuple(scalar_from_proto(v, f"{path}.values[{i}]") for i, v in enumerate(message.values))
        return Condition(message.key, op, None, values)
    if message.values:
        raise InvalidArgument(f"{path}.values", f"values are only for IN and NIN, not {op.name}")
    if op is Operator.EXISTS:
        if has_value:
            raise InvalidArgument(f"{path}.value", "EXISTS takes no value")
        return Condition(message.key, op)
    if not has_value:
        raise InvalidArgument(f"{path}.value", f"{op.name} requires a value")
    value = scalar_from_proto(message.value, f"{path}.value")
    if op in _ORDERING and isinstance(value, bool):
        raise InvalidArgument(f"{path}.value", f"{op.name} compares numbers or strings, not booleans")
    return Condition(message.key, op, value)


# --- SQL --------------------------------------------------------------------------------------

_COLUMN = re.compile(r"[a-z_][a-z0-9_.]*")


def compile_filter(filter: Filter, metadata_column: str, params: list[object]) -> str:
    """A SQL boolean expression for `filter` over the jsonb object column `metadata_column`.

    Keys and values only ever enter as bind parameters: each is appended to `params` and named
    `$N` with N its 1-based position, after whatever `params` already held. `metadata_column` is
    an identifier from our own code, never from a request. Parameters are passed as text and cast
    in SQL (`$N::text::jsonb`), so the result does not depend on the connection's jsonb codec.

    The expression is never NULL for a non-NULL column value, and `Not` uses `IS NOT TRUE`, so
    negation stays two-valued even if the column is NULL. Shapes (k = key, col = the column):

    - EQ: `col @> {"k": v}` (containment: same kind and equal; numbers numerically; a GIN
      `jsonb_path_ops` index can serve it); IN: an OR of such containments;
    - NE: `CASE WHEN jsonb_typeof(col -> k) = <kind of v> THEN NOT col @> {"k": v} ELSE false END`;
    - NIN: `col ? k AND NOT (<IN>)`; EXISTS: `col ? k`;
    - GT/GTE/LT/LTE, number: `CASE WHEN jsonb_typeof(col -> k) = 'number' THEN col -> k > v::jsonb
      ELSE false END` (jsonb compares numbers exactly, as numerics; CASE means nothing is cast or
      compared before the kind is known); string: the same with `col ->> k COLLATE "C" > v`.
    """
    if _COLUMN.fullmatch(metadata_column) is None:
        raise ValueError(f"not a trusted column identifier: {metadata_column!r}")

    def bind(value: object) -> str:
        params.append(value)
        return f"${len(params)}"

    return _sql(filter, metadata_column, bind)


def _sql(node: Filter, col: str, bind: Callable[[object], str]) -> str:
    if isinstance(node, Condition):
        return _condition_sql(node, col, bind)
    if isinstance(node, Not):
        return f"(({_sql(node.filter, col, bind)}) IS NOT TRUE)"
    if not node.filters:
        return "TRUE" if isinstance(node, AllOf) else "FALSE"
    joiner = " AND " if isinstance(node, AllOf) else " OR "
    return "(" + joiner.join(_sql(child, col, bind) for child in node.filters) + ")"


def _entry(key: str, value: MetadataScalar) -> str:
    """`{"key": value}` as JSON text, for containment."""
    return json.dumps({key: value}, ensure_ascii=False, allow_nan=False)


def _contains_any(
    col: str, key: str, values: tuple[MetadataScalar, ...], bind: Callable[[object], str]
) -> str:
    seen: set[tuple[str, MetadataScalar]] = set()
    terms: list[str] = []
    for value in values:
        if (scalar_kind(value), value) not in seen:
            seen.add((scalar_kind(value), value))
            terms.append(f"{col} @> {bind(_entry(key, value))}::text::jsonb")
    return "(" + " OR ".join(terms) + ")" if terms else "FALSE"


def _condition_sql(cond: Condition, col: str, bind: Callable[[object], str]) -> str:
    op = cond.op
    if op is Operator.EXISTS:
        return f"({col} ? {bind(cond.key)}::text)"
    if op in _LISTS:
        any_of = _contains_any(col, cond.key, cond.values, bind)
        return any_of if op is Operator.IN else f"({col} ? {bind(cond.key)}::text AND NOT {any_of})"
    value = _operand(cond)
    if op is Operator.EQ:
        return f"({col} @> {bind(_entry(cond.key, value))}::text::jsonb)"
    kind = scalar_kind(value)  # one of three constants of ours, never caller text
    if kind == "boolean" and op in _ORDERING:
        return "FALSE"  # booleans have no order; filter_from_proto refuses this
    key = bind(cond.key)
    if op is Operator.NE:
        compare = f"NOT ({col} @> {bind(_entry(cond.key, value))}::text::jsonb)"
    elif kind == "number":
        literal = bind(json.dumps(value, allow_nan=False))
        compare = f"({col} -> {key}::text) {_COMPARISONS[op][0]} {literal}::text::jsonb"
    else:
        compare = f'({col} ->> {key}::text) COLLATE "C" {_COMPARISONS[op][0]} {bind(value)}::text'
    return f"(CASE WHEN jsonb_typeof({col} -> {key}::text) = '{kind}' THEN {compare} ELSE false END)"


def _operand(cond: Condition) -> MetadataScalar:
    if cond.value is None:
        raise ValueError(f"{cond.op.name} condition on {cond.key!r} has no value")
    return cond.value


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
    if op in _LISTS:
        found = any(_equal(actual, value) for value in cond.values)
        return found if op is Operator.IN else not found
    value = _operand(cond)
    kind = scalar_kind(value)
    if scalar_kind(actual) != kind or (kind == "boolean" and op in _ORDERING):
        return False
    # Python orders str by code point, the UTF-8 byte order of PostgreSQL's "C" collation.
    return _COMPARISONS[op][1](actual, value)
