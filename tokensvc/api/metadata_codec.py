"""`MetadataValue` maps <-> metadata scalars: the proto side of `tokensvc.memory.metadata`.

Decoding applies the domain's rules (`memory.metadata`: entry count, key syntax, string size,
finite numbers) and names the offending entry, `<field>["<key>"]`, in every error.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

from tokensvc.errors import InvalidArgument
from tokensvc.memory.metadata import MetadataScalar, check_entry_count, check_key, check_scalar
from tokensvc.v1 import common_pb2

__all__ = [
    "metadata_from_proto",
    "metadata_to_proto",
    "scalar_from_proto",
    "scalar_to_proto",
    "set_metadata",
]


def scalar_from_proto(value: common_pb2.MetadataValue, field: str) -> MetadataScalar:
    """Validate one `MetadataValue` (kind set, string size, finite number); `field` is its path."""
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return check_scalar(value.string_value, field)
    if kind == "number_value":
        return check_scalar(value.number_value, field)
    if kind == "bool_value":
        return bool(value.bool_value)
    raise InvalidArgument(field, "value has no kind set (string_value, number_value or bool_value)")


def scalar_to_proto(value: MetadataScalar) -> common_pb2.MetadataValue:
    """One scalar as a `MetadataValue`; ints (from JSON) become numbers, bools stay bools."""
    if isinstance(value, bool):
        return common_pb2.MetadataValue(bool_value=value)
    if isinstance(value, str):
        return common_pb2.MetadataValue(string_value=value)
    return common_pb2.MetadataValue(number_value=float(value))


def metadata_from_proto(
    values: Mapping[str, common_pb2.MetadataValue], field: str
) -> dict[str, MetadataScalar]:
    """Validate a request's metadata map; `field` is its path (e.g. `items[0].metadata`).

    Entries are checked in key order, so the first error reported is deterministic.
    """
    check_entry_count(len(values), field)
    result: dict[str, MetadataScalar] = {}
    for key in sorted(values):
        result[key] = scalar_from_proto(values[key], check_key(key, field))
    return result


def set_metadata(
    target: MutableMapping[str, common_pb2.MetadataValue], values: Mapping[str, MetadataScalar]
) -> None:
    """Write `values` into a message's metadata map in place (no message copied per entry)."""
    for key, value in values.items():
        entry = target[key]
        if isinstance(value, bool):
            entry.bool_value = value
        elif isinstance(value, str):
            entry.string_value = value
        else:
            entry.number_value = float(value)


def metadata_to_proto(values: Mapping[str, MetadataScalar]) -> dict[str, common_pb2.MetadataValue]:
    """The inverse of `metadata_from_proto`, usable as a message constructor's map argument."""
    return {key: scalar_to_proto(value) for key, value in values.items()}
