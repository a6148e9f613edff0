"""Database credentials read from a secret source: a directory with `username` and `password`.

That is how a Kubernetes Secret arrives as a mounted volume: the files are symlinks into a
`..data` directory that the kubelet swaps atomically. We read the same way (resolve `..data`
once, then read both files from that one version) and, when tokensvc writes a credential itself
(ROTATE mode), we write the same way (a new version directory, then one atomic rename of the
`..data` link), so a reader never pairs one credential's username with another's password.
The password lives only in `DatabaseCredential` (a record in `tokensvc.storage.records`), whose
repr hides it. No SQL here: this is the file side of credential custody, shared by the serving
pool, the embedded server's bootstrap and `tokensvc.credentials`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path

from tokensvc.errors import Reason, TokensvcError
from tokensvc.storage.records import DatabaseCredential

__all__ = ["FileCredentialSource", "generate_password", "write_secret_file"]

_DATA = "..data"
_FILES = ("username", "password")
# Re-resolve `..data` this often when a concurrent write removes the version being read.
_READ_ATTEMPTS = 5


def generate_password() -> str:
    """A strong password: 256 random bits, URL-safe so it survives any secret store."""
    return secrets.token_urlsafe(32)


class FileCredentialSource:
    """Reads `<directory>/username` and `<directory>/password` on every call.

    Implements `tokensvc.storage.ports.CredentialSource`.
    """

    def __init__(self, directory: Path):
        self.directory = directory

    def __repr__(self) -> str:
        return f"FileCredentialSource({str(self.directory)!r})"

    def _version_dir(self) -> Path:
        data = self.directory / _DATA
        # Resolve the versioned directory once so both files come from the same version.
        return data.resolve() if data.is_symlink() else self.directory

    def read(self) -> DatabaseCredential:
        for attempt in range(_READ_ATTEMPTS):
            base = self._version_dir()
            try:
                username = (base / "username").read_text(encoding="utf-8").strip()
                password = (base / "password").read_text(encoding="utf-8").rstrip("\r\n")
            except OSError as exc:
                # A writer swapped `..data` and removed the version resolved above: read the new one.
                if attempt + 1 < _READ_ATTEMPTS and base != self.directory and base != self._version_dir():
                    continue
                raise TokensvcError(
                    f"database credential files in {self.directory} cannot be read ({exc.strerror})",
                    reason=Reason.CREDENTIAL_INVALID,
                ) from None
            # Plain files (no `..data` when resolved) may have become links into a `..data` that a
            # first write created meanwhile, each followed at its own moment: read that version.
            if base == self.directory and self._version_dir() != base and attempt + 1 < _READ_ATTEMPTS:
                continue
            break
        if not username or not password:
            raise TokensvcError(
                f"database credential in {self.directory} has an empty username or password",
                reason=Reason.CREDENTIAL_INVALID,
            )
        return DatabaseCredential(username, password)

    def stamp(self) -> tuple[int, ...]:
        """Cheap change detector: inode and mtime of the files as they resolve now."""
        parts: list[int] = []
        for name in _FILES:
            try:
                stat = (self.directory / name).stat()
            except OSError:
                parts += [-1, -1]
            else:
                parts += [stat.st_ino, stat.st_mtime_ns]
        return tuple(parts)

    def write(self, credential: DatabaseCredential) -> None:
        """Replace the credential atomically: both files appear together or not at all."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._adopt_versioned_layout()
        version = Path(
            tempfile.mkdtemp(dir=self.directory, prefix=f"..{time.strftime('%Y_%m_%d_%H_%M_%S')}.")
        )
        version.chmod(0o700)
        write_secret_file(version / "username", credential.username)
        write_secret_file(version / "password", credential.password)
        _fsync_dir(version)
        self._swap_data_link(version)

    def _adopt_versioned_layout(self) -> None:
        """Turn plain files into the `..data` layout, keeping the same credential throughout."""
        if (self.directory / _DATA).is_symlink():
            return
        files = {name: (self.directory / name) for name in _FILES}
        if all(path.is_file() and not path.is_symlink() for path in files.values()):
            current = self.read()
            version = Path(tempfile.mkdtemp(dir=self.directory, prefix="..initial."))
            version.chmod(0o700)
            write_secret_file(version / "username", current.username)
            write_secret_file(version / "password", current.password)
            self._swap_data_link(version)
        for name in _FILES:
            link = self.directory / name
            if not link.is_symlink():
                tmp = self.directory / f".{name}.link"
                tmp.unlink(missing_ok=True)
                tmp.symlink_to(Path(_DATA) / name)
                os.replace(tmp, link)  # the same credential as before, now through ..data
        _fsync_dir(self.directory)

    def _swap_data_link(self, version: Path) -> None:
        data = self.directory / _DATA
        previous = data.resolve() if data.is_symlink() else None
        tmp = self.directory / "..data_tmp"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(version.name)
        os.replace(tmp, data)  # the one atomic step
        _fsync_dir(self.directory)
        if (
            previous is not None
            and previous != version.resolve()
            and previous.parent == self.directory.resolve()
        ):
            shutil.rmtree(previous, ignore_errors=True)


def write_secret_file(path: Path, content: str) -> None:
    """Write mode-0600 content via a temporary file and rename, so no reader sees half of it."""
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(content)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp_name, 0o600)
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
