"""proto <-> domain conversions: Timestamps built from epoch integers equal protobuf's own."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from google.protobuf import timestamp_pb2

from tokensvc.api.convert import timestamp


def protobufs_own(value: datetime) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(value.astimezone(UTC))
    return stamp


@pytest.mark.parametrize(
    "value",
    [
        datetime(2025, 12, 1, 11, 23, 35, 123456, tzinfo=UTC),
        datetime(1970, 1, 1, tzinfo=UTC),
        datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),  # before the epoch: nanos stay >= 0
        datetime(1901, 3, 4, 5, 6, 7, 1, tzinfo=UTC),
        datetime(2262, 4, 11, 23, 47, 16, 854775, tzinfo=UTC),
        datetime(2025, 6, 30, 23, 0, 0, 500000, tzinfo=timezone(timedelta(hours=-7))),
        datetime(2025, 6, 30, 8, 15, tzinfo=timezone(timedelta(hours=5, minutes=45))),
        datetime(2025, 6, 30, 8, 15, 1, 42),  # naive: local time, as astimezone reads it
    ],
)
def test_timestamp_of_a_datetime_equals_protobufs_conversion(value: datetime) -> None:
    assert timestamp(value) == protobufs_own(value)


@pytest.mark.parametrize("value", [0, 1_764_588_215, -86_401, 1_764_588_215.999, -0.5])
def test_timestamp_of_epoch_seconds_keeps_whole_seconds(value: float) -> None:
    expected = timestamp_pb2.Timestamp()
    expected.FromSeconds(int(value))
    assert timestamp(value) == expected
