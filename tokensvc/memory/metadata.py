"""Typed metadata: validation of `MetadataValue` maps from the API and conversion back.

Metadata is a flat map from key to scalar: a string, a number or a boolean. It is stored as a
jsonb object whose values are JSON strings, JSON numbers and JSON booleans, so the filter
language (`tokensvc.memory.filters`) can compare numbers as numbers and strings as strings.

The contract is the one in `protos/tokensvc/v1/common.proto` (`MetadataValue`):

- at most 32 entries; keys are 1 to 64 characters from `A-Z`, `a-z`, `0-9`, `_`, `-`, `.`;
- a value must have exactly one kind set;
- string values are at most 1 KiB of UTF-8 and must not contain U+0000 (PostgreSQL cannot store
  it in jsonb or text, so it is refused up front rather than failing in the database);
- numbers must be finite. Every number is a double: an integer-valued number round-trips as a
  float (`3` comes back as `3.0`, which is the same `double` on the wire), and `-0.0` is stored
  as `0.0` (a JSON number in jsonb has no negative zero; both compare equal anyway);
- a boolean stays a boolean; it is never coerced to a number (`True` is not `1`).

Errors are `InvalidArgument` (string values over 1 KiB: `PayloadTooLarge`) whose field is the path
of the offending entry, `<field>["<key>"]`, following the proto's field-path convention.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping

from tokensvc.errors import InvalidArgument, PayloadTooLarge
from tokensvc.storage.filters import MetadataScalar, scalar_kind
from tokensvc.v1 import common_pb2

__all__ = [
    "MAX_METADATA_ENTRIES",
    "MAX_METADATA_KEY_CHARS",
    "MAX_METADATA_STRING_BYTES",
    "MetadataScalar",
    "is_valid_key",
    "key_path",
    "metadata_from_json",
    "metadata_from_proto",
    "metadata_to_proto",
    "scalar_from_proto",
    "scalar_kind",
    "scalar_to_proto",
]

MAX_METADATA_ENTRIES = 32
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_STRING_BYTES = 1024

_KEY = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
# How much of an invalid key is echoed back in an error path (it may be arbitrarily long).
_KEY_ECHO_CHARS = 80


def is_valid_key(key: str) -> bool:
    """Whether `key` has metadata-key syntax (shared by metadata maps and filter keys)."""
    return _KEY.fullmatch(key) is not None


def key_path(field: str, key: str) -> str:
    """The field path of a map entry, `field["key"]`; an invalid key is escaped and shortened."""
    if is_valid_key(key):
        return f'{field}["{key}"]'
    shown = key if len(key) <= _KEY_ECHO_CHARS else key[:_KEY_ECHO_CHARS] + "..."
    return f"{field}[{json.dumps(shown)}]"


def scalar_from_proto(value: common_pb2.MetadataValue, field: str) -> MetadataScalar:
    """Validate one `MetadataValue` (kind set, string size, finite number); `field` is its path."""
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        text = value.string_value
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError:
            raise InvalidArgument(field, "string value is not valid UTF-8") from None
        if size > MAX_METADATA_STRING_BYTES:
            raise PayloadTooLarge(
                field, f"string value is {size} bytes; the limit is {MAX_METADATA_STRING_BYTES}"
            )
        if "\x00" in text:
            raise InvalidArgument(field, "string value must not contain U+0000 (NUL)")
        return text
    if kind == "number_value":
        number = value.number_value
        if not math.isfinite(number):
            raise InvalidArgument(field, "number value must be finite (no NaN or infinity)")
        return number + 0.0  # normalises -0.0 to 0.0, as jsonb stores it
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
    if len(values) > MAX_METADATA_ENTRIES:
        raise InvalidArgument(
            field, f"metadata has {len(values)} entries; the limit is {MAX_METADATA_ENTRIES}"
        )
    result: dict[str, MetadataScalar] = {}
    for key in sorted(values):
        if not is_valid_key(key):
            raise InvalidArgument(
                key_path(field, key),
                f"metadata keys are 1 to {MAX_METADATA_KEY_CHARS} characters from A-Z a-z 0-9 _ - .",
            )
        result[key] = scalar_from_proto(values[key], key_path(field, key))
    return result


def metadata_from_json(values: Mapping[str, object]) -> dict[str, MetadataScalar]:
    """Stored metadata (jsonb decoded by `json.loads`) as scalars; trusts its input.

    jsonb prints an integer-valued number such as `1e16` without a fraction, which `json.loads`
    reads as an `int`; this turns it back into the `float` it was stored as.
    """
    result: dict[str, MetadataScalar] = {}
    for key, value in values.items():
        if isinstance(value, bool | str | float):
            result[key] = value
        elif isinstance(value, int):
            result[key] = float(value)
        else:
            raise TypeError(f"metadata value of {key!r} is {type(value).__name__}, not a scalar")
    return result


def metadata_to_proto(values: Mapping[str, MetadataScalar]) -> dict[str, common_pb2.MetadataValue]:
    """The inverse of `metadata_from_proto`, usable as a message constructor's map argument."""
    return {key: scalar_to_proto(value) for key, value in values.items()}
