"""Per-user storage buckets: HMAC-SHA256 of (namespace, agent, user) under a versioned pepper.

A bucket id is `v{n}.<base32>`: the pepper version, then the lowercase unpadded base32 of
`HMAC-SHA256(pepper_n, encoded)`, where `encoded` is a sequence of fields, each a 4-byte
big-endian length of its UTF-8 bytes followed by those bytes:

    per-user bucket:    ("user",  namespace, agent, user)
    agent-wide bucket:  ("agent", namespace, agent)

The leading tag separates the two domains, so the agent-wide bucket never equals any user's
bucket (not even user ""), and the length prefixes make field boundaries unambiguous. The raw user
id goes into the HMAC only; it is never returned, stored, logged or put in an error message.

Peppers live in a directory of files `v1`, `v2`, ... (base64url text of at least 32 random bytes),
typically a mounted Kubernetes Secret. New buckets use the newest version; `all_bucket_ids` gives
every version's bucket, newest first, so rows under an older pepper can be moved on first access.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Final

__all__ = [
    "MIN_PEPPER_BYTES",
    "PepperKeyring",
    "all_bucket_ids",
    "bucket_id",
    "parse_bucket_version",
]

MIN_PEPPER_BYTES: Final = 32
_MAX_PEPPER_FILE_BYTES: Final = 4096  # a pepper is ~44 characters; anything huge is a mistake
# Positive, no leading zeros (so `v01` and `v1` cannot both claim version 1), and bounded so
# int() never meets Python's digit limit.
_VERSION_NAME: Final = re.compile(r"v([1-9][0-9]{0,8})")
_BASE64URL: Final = re.compile(r"[A-Za-z0-9_-]+={0,2}")
_BUCKET_ID: Final = re.compile(r"v([1-9][0-9]{0,8})\.([a-z2-7]{52})")  # 52 = base32 of 32 bytes
_TAG_USER: Final = b"user"
_TAG_AGENT: Final = b"agent"
_MAX_FIELD_BYTES: Final = 0xFFFFFFFF


class PepperKeyring:
    """Versioned HMAC peppers. The repr and every error show versions and paths, never bytes."""

    __slots__ = ("_peppers",)

    def __init__(self, peppers: Mapping[int, bytes]) -> None:
        if not peppers:
            raise ValueError("a pepper keyring needs at least one version")
        for version, pepper in peppers.items():
            if version < 1:
                raise ValueError(f"pepper version {version} is not a positive integer")
            if len(pepper) < MIN_PEPPER_BYTES:
                raise ValueError(f"pepper version {version} is shorter than {MIN_PEPPER_BYTES} bytes")
        self._peppers: Mapping[int, bytes] = MappingProxyType({v: bytes(p) for v, p in peppers.items()})

    @classmethod
    def load(cls, directory: Path) -> PepperKeyring:
        """Read every `v<n>` file in `directory`; dotfiles (k8s `..data` and friends) are skipped.

        Raises ValueError naming the offending file (never its content) when the directory is
        missing or empty, a name is not `v<n>`, or a file is not base64url of >= 32 bytes.
        """
        if not directory.is_dir():
            raise ValueError(f"{directory}: pepper directory does not exist or is not a directory")
        peppers: dict[int, bytes] = {}
        for path in sorted(directory.iterdir()):
            if path.name.startswith("."):
                continue  # `..data`, `..2024_01_01/`, editor and temp files
            match = _VERSION_NAME.fullmatch(path.name)
            if match is None:
                raise ValueError(f"{path}: not a pepper file name; expected v1, v2, ... (no leading zeros)")
            # is_file() follows symlinks, so `v1 -> ..data/v1` in a mounted Secret is accepted.
            if not path.is_file():
                raise ValueError(f"{path}: pepper is not a regular file")
            peppers[int(match.group(1))] = _read_pepper(path)
        if not peppers:
            raise ValueError(f"{directory}: no pepper files (expected v1, v2, ...)")
        return cls(peppers)

    @property
    def versions(self) -> tuple[int, ...]:
        """Every version held, ascending."""
        return tuple(sorted(self._peppers))

    @property
    def newest_version(self) -> int:
        return max(self._peppers)

    def _pepper(self, version: int) -> bytes:
        try:
            return self._peppers[version]
        except KeyError:
            raise ValueError(f"pepper version {version} is not in the keyring {self.versions}") from None

    def __repr__(self) -> str:
        return f"PepperKeyring(versions={self.versions})"

    __str__ = __repr__


def bucket_id(
    keyring: PepperKeyring,
    namespace: str,
    agent: str,
    user: str | None,
    *,
    version: int | None = None,
) -> str:
    """The bucket `v{n}.<base32>` of `user` (or the agent-wide bucket when `user` is None).

    `version` defaults to the keyring's newest: new writes always use it.
    """
    n = keyring.newest_version if version is None else version
    fields: tuple[bytes, ...]
    if user is None:
        fields = (_TAG_AGENT, _utf8("namespace", namespace), _utf8("agent", agent))
    else:
        fields = (_TAG_USER, _utf8("namespace", namespace), _utf8("agent", agent), _utf8("user", user))
    digest = hmac.new(keyring._pepper(n), _length_prefixed(fields), hashlib.sha256).digest()
    return f"v{n}.{base64.b32encode(digest).decode('ascii').rstrip('=').lower()}"


def all_bucket_ids(keyring: PepperKeyring, namespace: str, agent: str, user: str | None) -> list[str]:
    """The bucket under every pepper version, newest first: [0] is where rows belong now."""
    return [
        bucket_id(keyring, namespace, agent, user, version=v) for v in sorted(keyring.versions, reverse=True)
    ]


def parse_bucket_version(bucket: str) -> int:
    """The pepper version of a bucket id; ValueError if it is not a well-formed bucket id."""
    match = _BUCKET_ID.fullmatch(bucket)
    if match is None:
        raise ValueError("not a bucket id (expected v<n>.<52 lowercase base32 characters>)")
    return int(match.group(1))


def _length_prefixed(fields: tuple[bytes, ...]) -> bytes:
    return b"".join(struct.pack(">I", len(field)) + field for field in fields)


def _utf8(name: str, value: str) -> bytes:
    # `from None`: a UnicodeEncodeError's text quotes the offending character of the value.
    try:
        encoded = value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name} is not valid Unicode text (lone surrogate)") from None
    if len(encoded) > _MAX_FIELD_BYTES:
        raise ValueError(f"{name} is too long to encode")
    return encoded


def _read_pepper(path: Path) -> bytes:
    # Errors name the file and the rule broken; they never quote the content, and `from None`
    # keeps decoder messages (which can quote bytes) out of the traceback.
    with path.open("rb") as handle:
        raw = handle.read(_MAX_PEPPER_FILE_BYTES + 1)
    if len(raw) > _MAX_PEPPER_FILE_BYTES:
        raise ValueError(f"{path}: pepper file is larger than {_MAX_PEPPER_FILE_BYTES} bytes")
    try:
        text = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise ValueError(f"{path}: pepper is not base64url text") from None
    if not text:
        raise ValueError(f"{path}: pepper file is empty")
    if not _BASE64URL.fullmatch(text) or len(text.rstrip("=")) % 4 == 1 or ("=" in text and len(text) % 4):
        raise ValueError(
            f"{path}: pepper is not base64url text (alphabet A-Z a-z 0-9 - _, optional = padding)"
        )
    unpadded = text.rstrip("=")
    pepper = base64.urlsafe_b64decode(unpadded + "=" * (-len(unpadded) % 4))
    if len(pepper) < MIN_PEPPER_BYTES:
        raise ValueError(f"{path}: pepper decodes to fewer than {MIN_PEPPER_BYTES} bytes")
    return pepper
