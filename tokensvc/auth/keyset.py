"""The trust bundle: a JWKS file of Ed25519 public keys that verify run capabilities, by `kid`.

A bundle is all-or-nothing: a file that is malformed, half-written, empty, lists a key that is not
an Ed25519 public key, or repeats a `kid` is refused as a whole and the previous keys stay in
force, so a bad deploy never locks every launcher out. The file is re-read when its (mtime, size,
inode) changes — checked at most once per `check_interval`, so a verify costs no syscall most of
the time — and on an explicit `reload()` (the admin RPC).
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from types import MappingProxyType

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from tokensvc.errors import Reason, TokensvcError

__all__ = ["TrustBundle"]

_LOG = logging.getLogger(__name__)

# A real bundle holds a handful of keys; anything this large is not one.
_MAX_BUNDLE_BYTES = 1 << 20
_ED25519_PUBLIC_BYTES = 32
# The JWK `alg` member is only a hint; RFC 9864 spells Ed25519 "Ed25519", older producers "EdDSA".
_JWK_ALGS = frozenset({"EdDSA", "Ed25519"})
# Members that only a private JWK has: a trust bundle carrying one leaks the signing key.
_PRIVATE_MEMBERS = frozenset({"d", "p", "q", "dp", "dq", "qi", "k"})

_Stamp = tuple[int, int, int]  # (mtime_ns, size, inode)
_UNSEEN: _Stamp = (-1, -1, -1)


class TrustBundle:
    """Ed25519 verification keys by `kid`, loaded from a JWKS file and reloaded when it changes."""

    def __init__(
        self, path: Path, *, check_interval: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._path = Path(path)
        self._check_interval = check_interval
        self._clock = clock
        self._keys: Mapping[str, Ed25519PublicKey] = MappingProxyType({})
        self._loaded_at: datetime | None = None
        self._generation = 0
        # The file version last read (whether or not it was valid), so a bad file is reported once.
        self._seen: _Stamp | None = _UNSEEN
        self._next_check = float("-inf")
        self._lock = threading.Lock()

    @property
    def path(self) -> Path:
        return self._path

    @property
    def kids(self) -> list[str]:
        return list(self._keys)

    @property
    def loaded_at(self) -> datetime | None:
        """When the keys in force were loaded (UTC); None until the first successful load."""
        return self._loaded_at

    @property
    def generation(self) -> int:
        """Bumped by every successful load, so caches of verified tokens can drop stale entries."""
        return self._generation

    def key(self, kid: str) -> Ed25519PublicKey | None:
        return self._keys.get(kid)

    def load(self) -> list[str]:
        """Read the file now; returns the kids. Raises TRUST_BUNDLE_INVALID and keeps the old keys."""
        with self._lock:
            return self._load_locked()

    reload = load

    def refresh_if_changed(self) -> bool:
        """Reload if the file changed since it was last read; True when new keys were loaded.

        Never raises for a bad file: the error is logged once per file version and the keys in
        force stay, because this runs on the request path.
        """
        now = self._clock()
        if now < self._next_check:
            return False
        with self._lock:
            if now < self._next_check:  # another thread checked meanwhile
                return False
            self._next_check = now + self._check_interval
            if _stat(self._path) == self._seen:
                return False
            try:
                self._load_locked()
            except TokensvcError as exc:
                _LOG.error(
                    "trust bundle reload failed; keeping the previous keys",
                    extra={"path": str(self._path), "error": exc.message, "kids": list(self._keys)},
                )
                return False
        _LOG.info("trust bundle reloaded", extra={"path": str(self._path), "kids": list(self._keys)})
        return True

    def _load_locked(self) -> list[str]:
        try:
            with self._path.open("rb") as handle:
                # fstat of the open file: the stamp describes exactly the bytes read below.
                stat = os.fstat(handle.fileno())
                self._seen = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
                data = handle.read(_MAX_BUNDLE_BYTES + 1)
        except OSError as exc:
            self._seen = None
            raise _invalid(self._path, f"cannot be read ({exc.strerror})") from None
        if len(data) > _MAX_BUNDLE_BYTES:
            raise _invalid(self._path, f"is larger than {_MAX_BUNDLE_BYTES} bytes")
        keys = _parse_jwks(self._path, data)
        self._keys = MappingProxyType(keys)
        self._loaded_at = datetime.now(UTC)
        self._generation += 1
        return list(keys)


def _stat(path: Path) -> _Stamp | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return (stat.st_mtime_ns, stat.st_size, stat.st_ino)


def _invalid(path: Path, what: str) -> TokensvcError:
    return TokensvcError(f"trust bundle {path} {what}", reason=Reason.TRUST_BUNDLE_INVALID)


def _parse_jwks(path: Path, data: bytes) -> dict[str, Ed25519PublicKey]:
    try:
        document = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise _invalid(path, "is not JSON (empty or half-written?)") from None
    keys = document.get("keys") if isinstance(document, dict) else None
    if not isinstance(keys, list) or not keys:
        raise _invalid(path, 'is not a JWKS: expected {"keys": [...]} with at least one key')
    parsed: dict[str, Ed25519PublicKey] = {}
    for index, jwk in enumerate(keys):
        kid, key = _parse_jwk(path, index, jwk)
        if kid in parsed:
            raise _invalid(path, f"lists kid {kid!r} more than once")
        parsed[kid] = key
    return parsed


def _parse_jwk(path: Path, index: int, jwk: object) -> tuple[str, Ed25519PublicKey]:
    where = f"keys[{index}]"
    if not isinstance(jwk, dict):
        raise _invalid(path, f"{where} is not a JSON object")
    if jwk.get("kty") != "OKP" or jwk.get("crv") != "Ed25519":
        raise _invalid(path, f'{where} is not an Ed25519 key (need "kty": "OKP", "crv": "Ed25519")')
    if _PRIVATE_MEMBERS & jwk.keys():
        raise _invalid(path, f"{where} contains private key material; publish only public keys")
    kid = jwk.get("kid")
    if not isinstance(kid, str) or not kid:
        raise _invalid(path, f'{where} needs a non-empty string "kid"')
    if jwk.get("use", "sig") != "sig" or jwk.get("alg", "EdDSA") not in _JWK_ALGS:
        raise _invalid(path, f'{where} ({kid!r}) is not a signature key ("use": "sig", "alg": "EdDSA")')
    raw = _b64url_decode(jwk.get("x"))
    if raw is None or len(raw) != _ED25519_PUBLIC_BYTES:
        raise _invalid(path, f'{where} ({kid!r}) "x" is not a base64url 32-byte Ed25519 public key')
    return kid, Ed25519PublicKey.from_public_bytes(raw)


def _b64url_decode(value: object) -> bytes | None:
    """Canonical unpadded base64url only, so one key has exactly one spelling."""
    if not isinstance(value, str) or not value.isascii() or "=" in value:
        return None
    try:
        raw = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
    except (binascii.Error, ValueError):
        return None
    if base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii") != value:
        return None
    return raw
