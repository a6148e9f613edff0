"""The one error table: every reason has a status code and matches the proto enum; database
failures reach it as domain errors, translated by exception class in storage."""

from __future__ import annotations

import asyncpg
import grpc
import pytest

from tokensvc import errors
from tokensvc.api.status import status_code_for_reason, status_for
from tokensvc.errors import Reason
from tokensvc.storage.postgres.errors import database_errors, domain_error
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
        assert isinstance(status_code_for_reason(reason), grpc.StatusCode)


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
    lost = domain_error(asyncpg.ConnectionDoesNotExistError("anything at all"))
    assert isinstance(lost, errors.DatabaseUnavailable)
    assert status_for(lost).code == grpc.StatusCode.UNAVAILABLE
    assert status_for(lost).reason == Reason.DATABASE_UNAVAILABLE
    cancelled = domain_error(asyncpg.QueryCanceledError("canceling statement due to user request"))
    assert isinstance(cancelled, errors.DeadlineExceeded)
    assert status_for(cancelled).code == grpc.StatusCode.DEADLINE_EXCEEDED
    # The same message on another class is not a connection failure.
    assert domain_error(asyncpg.CheckViolationError("connection does not exist")) is None
    # A transaction that lost to a concurrent one wrote nothing: retry (UNAVAILABLE), not INTERNAL.
    for lost_race in (
        asyncpg.SerializationError("tuple to be locked was already moved to another partition"),
        asyncpg.DeadlockDetectedError("deadlock detected"),
    ):
        conflict = domain_error(lost_race)
        assert isinstance(conflict, errors.DatabaseUnavailable), lost_race
        assert status_for(conflict).code == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(
    "failure",
    [
        asyncpg.CannotConnectNowError("the database system is starting up"),
        asyncpg.AdminShutdownError("terminating connection due to administrator command"),
        asyncpg.TooManyConnectionsError("sorry, too many clients already"),
        ConnectionResetError("connection reset by peer"),
        TimeoutError(),
    ],
)
def test_a_lost_or_unreachable_database_becomes_database_unavailable(failure: Exception) -> None:
    with pytest.raises(errors.DatabaseUnavailable) as caught, database_errors():
        raise failure
    assert caught.value.__cause__ is failure
    assert status_for(caught.value).code == grpc.StatusCode.UNAVAILABLE


def test_other_database_errors_pass_through_and_answer_internal_generically() -> None:
    refused = asyncpg.InsufficientPrivilegeError("new row violates row-level security policy for table")
    with pytest.raises(asyncpg.InsufficientPrivilegeError), database_errors():
        raise refused
    info = status_for(refused)
    assert info.code == grpc.StatusCode.INTERNAL
    assert info.internal
    assert "row-level security" not in info.message


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
