"""Typed metadata: the rules for metadata maps (no protobuf: `tokensvc.api.metadata_codec`
decodes `MetadataValue` maps and applies these checks).

Metadata is a flat map from key to scalar: a string, a number or a boolean. It is stored as a
jsonb object whose values are JSON strings, JSON numbers and JSON booleans, so the filter
language (`tokensvc.storage.filter_language`) can compare numbers as numbers and strings as strings.

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
from tokensvc.storage.filter_language import MetadataScalar, scalar_kind

__all__ = [
    "MAX_METADATA_ENTRIES",
    "MAX_METADATA_KEY_CHARS",
    "MAX_METADATA_STRING_BYTES",
    "MetadataScalar",
    "check_entry_count",
    "check_key",
    "check_scalar",
    "is_valid_key",
    "key_path",
    "metadata_from_json",
    "scalar_kind",
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


def check_scalar(value: MetadataScalar, field: str) -> MetadataScalar:
    """Validate one decoded scalar (string size, no NUL, finite number); `field` is its path.

    Returns the value as stored: a number normalised (`-0.0` becomes `0.0`, as jsonb stores it).
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            size = len(value.encode("utf-8"))
        except UnicodeEncodeError:
            raise InvalidArgument(field, "string value is not valid UTF-8") from None
        if size > MAX_METADATA_STRING_BYTES:
            raise PayloadTooLarge(
                field, f"string value is {size} bytes; the limit is {MAX_METADATA_STRING_BYTES}"
            )
        if "\x00" in value:
            raise InvalidArgument(field, "string value must not contain U+0000 (NUL)")
        return value
    if not math.isfinite(value):
        raise InvalidArgument(field, "number value must be finite (no NaN or infinity)")
    return value + 0.0  # normalises -0.0 to 0.0, as jsonb stores it


def check_entry_count(count: int, field: str) -> None:
    """At most `MAX_METADATA_ENTRIES` entries in one metadata map."""
    if count > MAX_METADATA_ENTRIES:
        raise InvalidArgument(field, f"metadata has {count} entries; the limit is {MAX_METADATA_ENTRIES}")


def check_key(key: str, field: str) -> str:
    """Validate a metadata key of the map at `field`; returns the entry's path, `field["key"]`."""
    path = key_path(field, key)
    if not is_valid_key(key):
        raise InvalidArgument(
            path, f"metadata keys are 1 to {MAX_METADATA_KEY_CHARS} characters from A-Z a-z 0-9 _ - ."
        )
    return path


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
