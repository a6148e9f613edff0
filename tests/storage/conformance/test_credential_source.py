"""CredentialSource: a written credential is read back whole (never one write's username with
another's password, even by a reader racing the writer, through another handle on the same
secret); the stamp changes with every write and with nothing else; a secret that is missing or
has an empty field is CREDENTIAL_INVALID. Run over files in a temporary directory and in process.

What only files can show (the `..data` layout, a kubelet-mounted secret, file modes, a write
that fails) is in tests/credentials/test_credential_source.py.
"""

from __future__ import annotations

import itertools
import sys
import threading
from collections.abc import Iterator

import pytest

from tests.storage.conformance.conftest import Secret
from tokensvc.errors import Reason, TokensvcError
from tokensvc.storage.ports import CredentialSource
from tokensvc.storage.records import DatabaseCredential

WRITES = 60


def numbered(index: int) -> DatabaseCredential:
    """Both fields encode `index`, so a torn pair shows."""
    return DatabaseCredential(f"tokensvc_app_{index}", f"secret-{index}-{'x' * (index % 13)}")


def index_of(credential: DatabaseCredential) -> tuple[int, int]:
    return int(credential.username.rsplit("_", 1)[1]), int(credential.password.split("-")[1])


def invalid(source: CredentialSource) -> TokensvcError:
    with pytest.raises(TokensvcError) as refused:
        source.read()
    return refused.value


@pytest.fixture
def busy_thread_switching() -> Iterator[None]:
    """Switch threads as often as possible, so a reader lands inside a writer's steps."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(previous)


def test_a_written_credential_is_read_back_through_any_handle(secret: Secret) -> None:
    writer, reader = secret.open(), secret.open()
    credential = DatabaseCredential("tokensvc_app_a", "a-password with spaces: and symbols !$'\"")

    writer.write(credential)

    assert reader.read() == credential
    assert writer.read() == credential
    writer.write(numbered(2))
    assert reader.read() == numbered(2)


def test_a_reader_racing_a_writer_sees_whole_credentials_only(
    secret: Secret, busy_thread_switching: None
) -> None:
    writer, reader = secret.open(), secret.open()
    writer.write(numbered(0))
    seen: list[tuple[int, int]] = []
    errors: list[str] = []
    done = threading.Event()

    def read_until_done() -> None:
        while not done.is_set():
            try:
                seen.append(index_of(reader.read()))
            except TokensvcError as exc:
                errors.append(exc.message)

    thread = threading.Thread(target=read_until_done)
    thread.start()
    try:
        for index in range(1, WRITES + 1):
            writer.write(numbered(index))
    finally:
        done.set()
        thread.join()

    assert len(seen) > 1
    assert [pair for pair in seen if pair[0] != pair[1]] == []
    assert errors == []
    assert [pair[0] for pair in seen] == sorted(pair[0] for pair in seen), "never an older one again"
    assert reader.read() == numbered(WRITES)


def test_the_stamp_changes_with_every_write_and_with_nothing_else(secret: Secret) -> None:
    writer, watcher = secret.open(), secret.open()
    stamps = [watcher.stamp()]
    assert watcher.stamp() == stamps[0]  # nothing written, nothing changed

    for index in range(1, 4):
        writer.write(numbered(index))
        stamps.append(watcher.stamp())
        watcher.read()
        writer.read()
        assert watcher.stamp() == stamps[-1], "reading changes nothing"
        assert writer.stamp() == stamps[-1], "every handle agrees"

    assert all(earlier != later for earlier, later in itertools.pairwise(stamps))
    assert all(isinstance(part, int) for stamp in stamps for part in stamp)


def test_a_secret_nothing_was_written_to_is_credential_invalid(secret: Secret) -> None:
    source = secret.open()

    assert invalid(source).reason is Reason.CREDENTIAL_INVALID
    assert source.stamp() == source.stamp()


@pytest.mark.parametrize(
    "credential",
    [
        DatabaseCredential("", "a-password"),
        DatabaseCredential("tokensvc_app_a", ""),
        DatabaseCredential("  \n", "a-password"),
        DatabaseCredential("tokensvc_app_a", "\r\n"),
    ],
    ids=["no-username", "no-password", "blank-username", "only-a-line-break"],
)
def test_an_empty_username_or_password_is_credential_invalid(
    secret: Secret, credential: DatabaseCredential
) -> None:
    source = secret.open()
    source.write(numbered(1))
    before = source.stamp()

    source.write(credential)

    refused = invalid(source)
    assert refused.reason is Reason.CREDENTIAL_INVALID
    assert credential.password.strip() == "" or credential.password not in refused.message
    assert source.stamp() != before  # it was written: a watcher wakes, and then refuses it


def test_surrounding_whitespace_of_the_username_and_line_breaks_ending_the_password_are_dropped(
    secret: Secret,
) -> None:
    source = secret.open()

    source.write(DatabaseCredential(" tokensvc_app_a\n", "a password \n"))

    assert source.read() == DatabaseCredential("tokensvc_app_a", "a password ")


def test_no_repr_shows_the_password(secret: Secret) -> None:
    password = "hunter2-but-longer-and-secret"
    source = secret.open()
    source.write(DatabaseCredential("tokensvc_app_a", password))

    for text in (repr(source), str(source), repr(source.read()), repr(secret.open())):
        assert password not in text
