"""Typed metadata: the proto contract's limits with exact field paths, and faithful round trips."""

from __future__ import annotations

import json
import math

import grpc
import pytest

from tests.support import SharedDatabase, superuser
from tokensvc.api.metadata_codec import metadata_from_proto, metadata_to_proto, scalar_to_proto
from tokensvc.api.status import status_for
from tokensvc.errors import InvalidArgument, PayloadTooLarge, Reason
from tokensvc.memory.metadata import MetadataScalar, metadata_from_json
from tokensvc.v1 import common_pb2 as pb

FIELD = "items[0].metadata"


def proto_map(values: dict[str, MetadataScalar | pb.MetadataValue]) -> dict[str, pb.MetadataValue]:
    return {k: v if isinstance(v, pb.MetadataValue) else scalar_to_proto(v) for k, v in values.items()}


def invalid(values: dict[str, MetadataScalar | pb.MetadataValue]) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as caught:
        metadata_from_proto(proto_map(values), FIELD)
    assert status_for(caught.value).code is grpc.StatusCode.INVALID_ARGUMENT
    return caught.value


def test_typed_values_keep_their_types() -> None:
    metadata = metadata_from_proto(
        proto_map({"lang": "en", "year": 2024.0, "draft": True, "score": -1.5, "off": False}), FIELD
    )
    assert metadata == {"lang": "en", "year": 2024.0, "draft": True, "score": -1.5, "off": False}
    assert {k: type(v) for k, v in metadata.items()} == {
        "lang": str,
        "year": float,
        "draft": bool,
        "score": float,
        "off": bool,
    }


def test_a_value_without_a_kind_is_invalid_argument_naming_the_entry() -> None:
    error = invalid({"lang": "en", "topic": pb.MetadataValue()})
    assert error.field == f'{FIELD}["topic"]'
    assert error.reason is Reason.INVALID_ARGUMENT


@pytest.mark.parametrize("number", [math.nan, math.inf, -math.inf])
def test_non_finite_numbers_are_refused(number: float) -> None:
    assert invalid({"ok": 1.0, "x": number}).field == f'{FIELD}["x"]'


def test_thirty_two_entries_are_accepted_and_thirty_three_are_not() -> None:
    assert len(metadata_from_proto(proto_map({f"k{i}": float(i) for i in range(32)}), FIELD)) == 32
    assert invalid({f"k{i}": float(i) for i in range(33)}).field == FIELD


@pytest.mark.parametrize(
    ("key", "path"),
    [
        ("", f'{FIELD}[""]'),
        ("k" * 65, f'{FIELD}["{"k" * 65}"]'),
        ("a b", f'{FIELD}["a b"]'),
        ("a\n", f'{FIELD}["a\\n"]'),
        ('say "hi"', f'{FIELD}["say \\"hi\\""]'),
        ("ключ", f'{FIELD}["\\u043a\\u043b\\u044e\\u0447"]'),
        ("k" * 500, f'{FIELD}["{"k" * 80}..."]'),
    ],
)
def test_bad_keys_are_refused_with_an_escaped_path(key: str, path: str) -> None:
    assert invalid({key: "x"}).field == path


def test_key_syntax_accepts_the_documented_alphabet() -> None:
    key = "Az09_.-" + "x" * 57
    assert metadata_from_proto(proto_map({key: 1.0, "a": 2.0}), FIELD) == {key: 1.0, "a": 2.0}


def test_string_values_are_limited_to_one_kib_of_utf8() -> None:
    at_limit = "é" * 512  # 1,024 bytes in 512 characters
    assert metadata_from_proto(proto_map({"s": at_limit}), FIELD) == {"s": at_limit}
    with pytest.raises(PayloadTooLarge) as caught:
        metadata_from_proto(proto_map({"s": at_limit + "x"}), FIELD)
    assert caught.value.field == f'{FIELD}["s"]'
    assert status_for(caught.value).code is grpc.StatusCode.INVALID_ARGUMENT


def test_nul_characters_are_refused_because_postgresql_cannot_store_them() -> None:
    assert invalid({"s": "a\x00b"}).field == f'{FIELD}["s"]'


def test_errors_are_reported_in_key_order() -> None:
    assert invalid({"b": math.nan, "a": pb.MetadataValue()}).field == f'{FIELD}["a"]'


def test_negative_zero_is_stored_as_zero() -> None:
    number = metadata_from_proto(proto_map({"z": -0.0}), FIELD)["z"]
    assert number == 0.0
    assert math.copysign(1.0, number) == 1.0


def test_to_proto_is_the_inverse_and_never_turns_booleans_into_numbers() -> None:
    metadata: dict[str, MetadataScalar] = {"t": True, "f": False, "one": 1.0, "s": "1", "big": 1e308}
    message = metadata_to_proto(metadata)
    assert {k: v.WhichOneof("kind") for k, v in message.items()} == {
        "t": "bool_value",
        "f": "bool_value",
        "one": "number_value",
        "s": "string_value",
        "big": "number_value",
    }
    assert metadata_from_proto(message, FIELD) == metadata
    # Usable directly as a message's map field.
    assert pb.MetadataValue(bool_value=True) in message.values()


async def test_metadata_round_trips_through_jsonb(database: SharedDatabase) -> None:
    """Stored as JSON strings, numbers and booleans; read back with the pool's codec, the same."""
    original: dict[str, MetadataScalar] = {
        "int_valued": 3.0,
        "exp": 1e16,
        "max": 1.7976931348623157e308,
        "tiny": 5e-324,
        "neg": -2.5,
        "zero": -0.0,
        "flag": True,
        "no": False,
        "text": 'ü😀 "quoted" \'; DROP TABLE x; --',
        "empty": "",
    }
    stored = metadata_from_proto(metadata_to_proto(original), FIELD)
    async with superuser(database) as conn:
        await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")
        row = await conn.fetchrow(
            "SELECT $1::jsonb AS m, jsonb_typeof($1::jsonb -> 'flag') AS flag_type, "
            "jsonb_typeof($1::jsonb -> 'int_valued') AS int_type",
            stored,
        )
    assert row is not None
    assert (row["flag_type"], row["int_type"]) == ("boolean", "number")
    read_back = metadata_from_json(row["m"])
    assert read_back == original
    # An integer-valued number comes back as a float; booleans stay booleans.
    assert {k: type(v) for k, v in read_back.items()} == {k: type(v) for k, v in original.items()}
    assert metadata_to_proto(read_back) == metadata_to_proto(stored)
