"""The one error table: every reason has a status code and matches the proto enum."""

from __future__ import annotations

import asyncpg
import grpc
import pytest

from tokensvc import errors
from tokensvc.errors import Reason, status_for
from tokensvc.v1 import common_pb2

PROTO_PREFIX = "ERROR_REASON_"


def test_reasons_mirror_the_proto_error_reason_enum_exactly() -> None:
    proto_names = {
        name.removeprefix(PROTO_PREFIX)
        for name in common_pb2.ErrorReason.DESCRIPTOR.values_by_name
        if name != f"{PROTO_PREFIX}UNSPECIFIED"
    }
    assert proto_names == {reason.value for reason in Reason}


def test_every_reason_maps_to_a_status_code() -> None:
    for reason in Reason:
        assert isinstance(errors.status_code_for_reason(reason), grpc.StatusCode)


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (errors.InvalidArgument("items[0].content", "too long"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.CapabilityExpired(), grpc.StatusCode.UNAUTHENTICATED),
        (errors.PermissionDenied(Reason.BINDING_MISMATCH), grpc.StatusCode.PERMISSION_DENIED),
        (errors.PinnedConfiguration("embedder is pinned"), grpc.StatusCode.FAILED_PRECONDITION),
        (errors.DatabaseUnavailable(), grpc.StatusCode.UNAVAILABLE),
        (errors.ConcurrencyLimit("too many"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    ],
)
def test_domain_errors_map_through_the_table(error: errors.TokensvcError, code: grpc.StatusCode) -> None:
    info = status_for(error)
    assert info.code == code
    assert info.reason == error.reason
    assert not info.internal


def test_invalid_argument_names_its_field() -> None:
    info = status_for(errors.InvalidArgument("items[3].content", "exceeds 32768 bytes"))
    assert info.field == "items[3].content"
    assert "items[3].content" in info.message


def test_database_errors_are_translated_by_class_not_message() -> None:
    lost = asyncpg.ConnectionDoesNotExistError("anything at all")
    assert status_for(lost).reason == Reason.DATABASE_UNAVAILABLE
    cancelled = asyncpg.QueryCanceledError("canceling statement due to user request")
    assert status_for(cancelled).code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_unknown_errors_become_internal_with_a_generic_message() -> None:
    info = status_for(KeyError("secret-table-name"))
    assert info.code == grpc.StatusCode.INTERNAL
    assert info.internal
    assert "secret-table-name" not in info.message


def test_unauthenticated_messages_never_say_which_check_failed() -> None:
    messages = {
        status_for(error).message
        for error in (errors.CapabilityExpired(), errors.CapabilityInvalid(), errors.CapabilityRevoked())
    }
    assert messages == {"the run capability was not accepted"}
