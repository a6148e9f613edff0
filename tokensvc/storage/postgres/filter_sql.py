"""The filter language compiled to SQL (semantics: `tokensvc.storage.filter_language`)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from tokensvc.storage.filter_language import (
    COMPARISONS,
    LIST_OPERATORS,
    ORDERING_OPERATORS,
    AllOf,
    Condition,
    Filter,
    MetadataScalar,
    Not,
    Operator,
    operand,
    scalar_kind,
)

__all__ = ["compile_filter"]

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
    if op in LIST_OPERATORS:
        any_of = _contains_any(col, cond.key, cond.values, bind)
        return any_of if op is Operator.IN else f"({col} ? {bind(cond.key)}::text AND NOT {any_of})"
    value = operand(cond)
    if op is Operator.EQ:
        return f"({col} @> {bind(_entry(cond.key, value))}::text::jsonb)"
    kind = scalar_kind(value)  # one of three constants of ours, never caller text
    if kind == "boolean" and op in ORDERING_OPERATORS:
        return "FALSE"  # booleans have no order; filter_from_proto refuses this
    key = bind(cond.key)
    if op is Operator.NE:
        compare = f"NOT ({col} @> {bind(_entry(cond.key, value))}::text::jsonb)"
    elif kind == "number":
        literal = bind(json.dumps(value, allow_nan=False))
        compare = f"({col} -> {key}::text) {COMPARISONS[op][0]} {literal}::text::jsonb"
    else:
        compare = f'({col} ->> {key}::text) COLLATE "C" {COMPARISONS[op][0]} {bind(value)}::text'
    return f"(CASE WHEN jsonb_typeof({col} -> {key}::text) = '{kind}' THEN {compare} ELSE false END)"
