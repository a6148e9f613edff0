"""The metadata filter language from the proto: validation into the tree of
`tokensvc.storage.filter_language` (whose docstring states the semantics).

The API edge builds it with `filter_from_proto`, which enforces the contract written in
`protos/tokensvc/v1/common.proto` (`Filter`, `FieldFilter`, `FilterOperator`) and names the
offending node in every error. An unset filter field means "no filter": callers check
`request.HasField("filter")` and pass `None` down instead of calling `filter_from_proto`.
"""

from __future__ import annotations

from tokensvc.api.metadata_codec import scalar_from_proto
from tokensvc.errors import InvalidArgument
from tokensvc.memory import (
    LIST_OPERATORS,
    ORDERING_OPERATORS,
    AllOf,
    AnyOf,
    Condition,
    Filter,
    Not,
    Operator,
)
from tokensvc.memory.metadata import MAX_METADATA_KEY_CHARS, is_valid_key
from tokensvc.v1 import common_pb2

__all__ = ["MAX_FILTER_DEPTH", "MAX_FILTER_NODES", "MAX_FILTER_VALUES", "filter_from_proto"]

MAX_FILTER_DEPTH = 8
"""Levels of nesting: a lone condition is 1 level, an `and` of conditions 2."""
MAX_FILTER_NODES = 64
"""`Filter` messages in total (a leaf counts once, with its `FieldFilter`)."""
MAX_FILTER_VALUES = 100
"""Values of one IN or NIN."""

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
    if op in LIST_OPERATORS:
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
    if op in ORDERING_OPERATORS and isinstance(value, bool):
        raise InvalidArgument(f"{path}.value", f"{op.name} compares numbers or strings, not booleans")
    return Condition(message.key, op, value)
