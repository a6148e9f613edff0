"""The secret source: atomic credential pairs, the `..data` layout, and no password in any repr."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tokensvc.credentials import DatabaseCredential, FileCredentialSource
from tokensvc.errors import Reason, TokensvcError

WRITES = 200


def numbered(index: int) -> DatabaseCredential:
    """A credential whose username and password both encode `index`, so a torn pair shows."""
    return DatabaseCredential(f"role_{index}", f"secret-{index}-{'x' * (index % 17)}")


def index_of(credential: DatabaseCredential) -> tuple[int, int]:
    return int(credential.username.removeprefix("role_")), int(credential.password.split("-")[1])


@pytest.fixture
def busy_thread_switching() -> Iterator[None]:
    """Switch threads as often as possible, so a reader lands inside a writer's steps."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(previous)


def read_while(
    source: FileCredentialSource, write: threading.Event
) -> tuple[list[tuple[int, int]], list[str]]:
    """Read in a tight loop until `write` is done; every pair seen and every read error."""
    seen: list[tuple[int, int]] = []
    errors: list[str] = []
    while not write.is_set():
        try:
            seen.append(index_of(source.read()))
        except TokensvcError as exc:
            errors.append(exc.message)
    return seen, errors


def run_reader(
    source: FileCredentialSource, writer: Callable[[], None]
) -> tuple[list[tuple[int, int]], list[str]]:
    done = threading.Event()
    result: dict[str, tuple[list[tuple[int, int]], list[str]]] = {}
    reader = threading.Thread(target=lambda: result.setdefault("r", read_while(source, done)))
    reader.start()
    try:
        writer()
    finally:
        done.set()
        reader.join()
    return result["r"]


def test_reader_never_sees_a_username_of_one_write_with_the_password_of_another(
    tmp_path: Path, busy_thread_switching: None
) -> None:
    directory = tmp_path / "app"
    FileCredentialSource(directory).write(numbered(0))
    reader_source = FileCredentialSource(directory)

    def write_all() -> None:
        writer = FileCredentialSource(directory)
        for index in range(1, WRITES + 1):
            writer.write(numbered(index))

    seen, errors = run_reader(reader_source, write_all)

    assert len(seen) > WRITES  # the reader really raced the writer
    torn = [pair for pair in seen if pair[0] != pair[1]]
    assert torn == []
    assert errors == []  # a swapped-out version is re-resolved, never reported as unreadable
    assert len({pair[0] for pair in seen}) > 10
    assert reader_source.read() == numbered(WRITES)
    # Old versions are removed: one version directory, the link and the two file links remain.
    versions = [p.name for p in directory.iterdir() if p.name.startswith("..") and p.name != "..data"]
    assert len(versions) == 1
    assert sorted(p.name for p in directory.iterdir() if not p.name.startswith("..")) == [
        "password",
        "username",
    ]


def test_plain_files_are_adopted_into_the_data_layout_without_changing_the_credential(
    tmp_path: Path, busy_thread_switching: None
) -> None:
    directory = tmp_path / "plain"
    directory.mkdir()
    (directory / "username").write_text("tokensvc_app_a\n")
    (directory / "password").write_text("plain-old-password\n")
    source = FileCredentialSource(directory)
    before = source.read()
    assert before == DatabaseCredential("tokensvc_app_a", "plain-old-password")
    new = DatabaseCredential("tokensvc_app_b", "brand-new-password")

    seen: list[DatabaseCredential] = []
    errors: list[str] = []
    done = threading.Event()

    def read_loop() -> None:
        while not done.is_set():
            try:
                seen.append(source.read())
            except TokensvcError as exc:
                errors.append(exc.message)

    reader = threading.Thread(target=read_loop)
    reader.start()
    try:
        source._adopt_versioned_layout()
        adopted = source.read()
        FileCredentialSource(directory).write(new)
    finally:
        done.set()
        reader.join()

    assert adopted == before  # adoption alone changes nothing a reader can see
    assert set(seen) <= {before, new}
    assert errors == []
    assert (directory / "..data").is_symlink()
    for name in ("username", "password"):
        link = directory / name
        assert link.is_symlink()
        assert os.readlink(link) == f"..data/{name}"
    assert source.read() == new


def test_adopting_an_already_versioned_directory_keeps_it(tmp_path: Path) -> None:
    directory = tmp_path / "app"
    source = FileCredentialSource(directory)
    source.write(numbered(1))
    target = os.readlink(directory / "..data")
    source._adopt_versioned_layout()
    assert os.readlink(directory / "..data") == target
    assert source.read() == numbered(1)


def kubernetes_mount(directory: Path, version: str, credential: DatabaseCredential) -> None:
    """What the kubelet's AtomicWriter leaves for a Secret volume."""
    versioned = directory / version
    versioned.mkdir(parents=True)
    (versioned / "username").write_text(credential.username)
    (versioned / "password").write_text(credential.password + "\n")
    (directory / "..data").symlink_to(version)
    for name in ("username", "password"):
        (directory / name).symlink_to(f"..data/{name}")


def test_a_kubernetes_mounted_secret_is_read_and_can_be_rewritten(tmp_path: Path) -> None:
    directory = tmp_path / "mounted"
    original = DatabaseCredential("tokensvc_app_a", "from-the-kubelet")
    kubernetes_mount(directory, "..2026_11_29_20_17_04.1234567890", original)
    source = FileCredentialSource(directory)
    assert source.read() == original

    # The kubelet swaps to a new version the same way.
    second = DatabaseCredential("tokensvc_app_b", "second-from-the-kubelet")
    (directory / "..2026_11_29_21_00_00.42").mkdir()
    (directory / "..2026_11_29_21_00_00.42" / "username").write_text(second.username)
    (directory / "..2026_11_29_21_00_00.42" / "password").write_text(second.password)
    (directory / "..data_tmp").symlink_to("..2026_11_29_21_00_00.42")
    os.replace(directory / "..data_tmp", directory / "..data")
    assert source.read() == second

    # tokensvc writing into the mounted layout swaps `..data` and removes the version it replaced.
    third = DatabaseCredential("tokensvc_app_a", "written-by-tokensvc")
    source.write(third)
    assert source.read() == third
    assert not (directory / "..2026_11_29_21_00_00.42").exists()
    assert (directory / "..2026_11_29_20_17_04.1234567890").exists()  # not ours to remove now


def test_missing_or_empty_files_are_credential_invalid(tmp_path: Path) -> None:
    with pytest.raises(TokensvcError) as missing:
        FileCredentialSource(tmp_path / "absent").read()
    assert missing.value.reason is Reason.CREDENTIAL_INVALID
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "username").write_text("tokensvc_app_a")
    (empty / "password").write_text("\n")
    with pytest.raises(TokensvcError) as blank:
        FileCredentialSource(empty).read()
    assert blank.value.reason is Reason.CREDENTIAL_INVALID


def test_written_files_are_private(tmp_path: Path) -> None:
    directory = tmp_path / "app"
    FileCredentialSource(directory).write(numbered(3))
    version = (directory / "..data").resolve()
    assert version.stat().st_mode & 0o777 == 0o700
    for name in ("username", "password"):
        assert (version / name).stat().st_mode & 0o777 == 0o600


def test_repr_never_shows_the_password(tmp_path: Path) -> None:
    password = "hunter2-but-longer-and-secret"
    credential = DatabaseCredential("tokensvc_app_a", password)
    source = FileCredentialSource(tmp_path / "app")
    source.write(credential)
    shown = [repr(credential), str(credential), f"{credential!r}", repr(source), str(source)]
    shown.append(repr(source.read()))
    shown.append(repr([credential, {"c": credential}]))
    for text in shown:
        assert password not in text
    assert "tokensvc_app_a" in repr(credential)


def test_fingerprint_tells_credentials_apart_without_containing_the_password() -> None:
    credentials = [
        DatabaseCredential("tokensvc_app_a", "password-one"),
        DatabaseCredential("tokensvc_app_a", "password-two"),
        DatabaseCredential("tokensvc_app_b", "password-one"),
        *(numbered(i) for i in range(50)),
    ]
    fingerprints = [credential.fingerprint for credential in credentials]
    assert len(set(fingerprints)) == len(credentials)
    for credential, fingerprint in zip(credentials, fingerprints, strict=True):
        assert credential.password not in fingerprint
        assert fingerprint not in credential.password
        assert fingerprint == DatabaseCredential(credential.username, credential.password).fingerprint


def test_a_read_overtaken_by_the_first_write_into_plain_files_is_never_torn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader that found plain files (no `..data` yet) reads them through the links the first
    write puts in their place: the writer adopting the layout and swapping in a new version between
    the reader's two files must not pair the old username with the new password."""
    directory = tmp_path / "plain"
    directory.mkdir()
    (directory / "username").write_text("tokensvc_app_a\n")
    (directory / "password").write_text("plain-old-password\n")
    before = DatabaseCredential("tokensvc_app_a", "plain-old-password")
    new = DatabaseCredential("tokensvc_app_b", "brand-new-password")
    reader = FileCredentialSource(directory)
    read_text = Path.read_text
    overtaken: list[bool] = []

    def read_then_let_the_writer_run(path: Path, *args: Any, **kwargs: Any) -> str:
        text = read_text(path, *args, **kwargs)
        if path.name == "username" and not overtaken:
            overtaken.append(True)
            FileCredentialSource(directory).write(new)  # between the reader's username and password
        return text

    monkeypatch.setattr(Path, "read_text", read_then_let_the_writer_run)
    seen = reader.read()
    monkeypatch.undo()

    assert overtaken == [True]
    assert seen in (before, new)
    assert reader.read() == new
