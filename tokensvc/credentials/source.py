"""Database credentials read from a secret source: a directory with `username` and `password`.

That is how a Kubernetes Secret arrives as a mounted volume. The files are re-read for every new
connection, so a credential changed on disk is used without a restart. The password lives only in
`DatabaseCredential`, whose repr hides it.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tokensvc.errors import Reason, TokensvcError

__all__ = ["DatabaseCredential", "FileCredentialSource", "write_secret_file"]


@dataclass(frozen=True)
class DatabaseCredential:
    username: str
    password: str = field(repr=False)


class FileCredentialSource:
    """Reads `<directory>/username` and `<directory>/password` on every call."""

    def __init__(self, directory: Path):
        self.directory = directory

    def __repr__(self) -> str:
        return f"FileCredentialSource({str(self.directory)!r})"

    def read(self) -> DatabaseCredential:
        try:
            username = (self.directory / "username").read_text(encoding="utf-8").strip()
            password = (self.directory / "password").read_text(encoding="utf-8").rstrip("\r\n")
        except OSError as exc:
            raise TokensvcError(
                f"database credential files in {self.directory} cannot be read ({exc.strerror})",
                reason=Reason.CREDENTIAL_INVALID,
            ) from None
        if not username or not password:
            raise TokensvcError(
                f"database credential in {self.directory} has an empty username or password",
                reason=Reason.CREDENTIAL_INVALID,
            )
        return DatabaseCredential(username, password)

    def write(self, credential: DatabaseCredential) -> None:
        """Replace the credential atomically: the password first, since a reader pairs them."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_secret_file(self.directory / "password", credential.password)
        write_secret_file(self.directory / "username", credential.username)


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
