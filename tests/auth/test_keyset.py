"""The trust bundle: strict JWKS parsing, all-or-nothing reloads, and change detection by stat."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from tokensvc.auth.devpki import public_jwk
from tokensvc.auth.keyset import TrustBundle
from tokensvc.errors import Reason, TokensvcError


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def raw(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def write_atomically(path: Path, data: bytes | str) -> None:
    """Replace the file the way deploy tooling does: a new inode renamed into place."""
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)


def jwks(*keys: dict[str, Any]) -> str:
    return json.dumps({"keys": list(keys)})


@pytest.fixture
def key_a() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


@pytest.fixture
def key_b() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


@pytest.fixture
def bundle_path(tmp_path: Path, key_a: Ed25519PrivateKey) -> Path:
    path = tmp_path / "trust-bundle.jwks"
    write_atomically(path, jwks(public_jwk(key_a.public_key(), "key-a")))
    return path


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def bundle(bundle_path: Path, clock: FakeClock) -> TrustBundle:
    trust = TrustBundle(bundle_path, check_interval=1.0, clock=clock)
    trust.load()
    return trust


def test_load_returns_kids_and_keys_by_kid(bundle: TrustBundle, key_a: Ed25519PrivateKey) -> None:
    assert bundle.kids == ["key-a"]
    loaded = bundle.key("key-a")
    assert loaded is not None
    assert raw(loaded) == raw(key_a.public_key())
    assert bundle.key("key-b") is None
    assert bundle.loaded_at is not None
    assert bundle.loaded_at.tzinfo is dt.UTC


def test_dev_bundle_format_with_several_keys_loads(tmp_path: Path) -> None:
    keys = [Ed25519PrivateKey.generate() for _ in range(3)]
    path = tmp_path / "b.jwks"
    write_atomically(path, jwks(*(public_jwk(k.public_key(), f"k{i}") for i, k in enumerate(keys))))
    assert TrustBundle(path).reload() == ["k0", "k1", "k2"]


def test_unloaded_bundle_has_no_keys(bundle_path: Path) -> None:
    trust = TrustBundle(bundle_path)
    assert trust.kids == []
    assert trust.key("key-a") is None
    assert trust.loaded_at is None


def _ok(key: Ed25519PrivateKey, kid: str = "k") -> dict[str, Any]:
    return public_jwk(key.public_key(), kid)


_X = "11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"  # a valid base64url 32-byte value


MALFORMED_BUNDLES: dict[str, str] = {
    "empty file": "",
    "half-written": jwks({"kty": "OKP", "crv": "Ed25519", "x": _X, "kid": "k"})[:30],
    "not json": "keys: [k]",
    "json array": "[]",
    "json string": '"keys"',
    "no keys member": "{}",
    "empty key list": jwks(),
    "keys not a list": json.dumps({"keys": {"kid": "k"}}),
    "key not an object": json.dumps({"keys": ["k"]}),
    "rsa key": jwks({"kty": "RSA", "n": "AQAB", "e": "AQAB", "kid": "k"}),
    "ec key": jwks({"kty": "EC", "crv": "P-256", "x": _X, "y": _X, "kid": "k"}),
    "x25519 key": jwks({"kty": "OKP", "crv": "X25519", "x": _X, "kid": "k"}),
    "ed448 key": jwks({"kty": "OKP", "crv": "Ed448", "x": _X, "kid": "k"}),
    "missing kid": jwks({"kty": "OKP", "crv": "Ed25519", "x": _X}),
    "empty kid": jwks({"kty": "OKP", "crv": "Ed25519", "x": _X, "kid": ""}),
    "integer kid": jwks({"kty": "OKP", "crv": "Ed25519", "x": _X, "kid": 7}),
    "missing x": jwks({"kty": "OKP", "crv": "Ed25519", "kid": "k"}),
    "x not base64url": jwks({"kty": "OKP", "crv": "Ed25519", "x": "!" * 43, "kid": "k"}),
    "x padded": jwks({"kty": "OKP", "crv": "Ed25519", "x": _X + "=", "kid": "k"}),
    "x wrong length": jwks({"kty": "OKP", "crv": "Ed25519", "x": _X[:40], "kid": "k"}),
    "private key material": jwks({"kty": "OKP", "crv": "Ed25519", "x": _X, "d": _X, "kid": "k"}),
    "encryption key": jwks({"kty": "OKP", "crv": "Ed25519", "x": _X, "kid": "k", "use": "enc"}),
    "rsa alg": jwks({"kty": "OKP", "crv": "Ed25519", "x": _X, "kid": "k", "alg": "RS256"}),
    "duplicate kid": jwks(
        {"kty": "OKP", "crv": "Ed25519", "x": _X, "kid": "k"},
        {"kty": "OKP", "crv": "Ed25519", "x": _X, "kid": "k"},
    ),
}


@pytest.mark.parametrize("content", MALFORMED_BUNDLES.values(), ids=MALFORMED_BUNDLES.keys())
def test_malformed_bundle_is_refused_and_previous_keys_stay(
    bundle: TrustBundle, bundle_path: Path, content: str
) -> None:
    loaded_at = bundle.loaded_at
    write_atomically(bundle_path, content)
    with pytest.raises(TokensvcError) as caught:
        bundle.reload()
    assert caught.value.reason is Reason.TRUST_BUNDLE_INVALID
    assert bundle.kids == ["key-a"]
    assert bundle.key("key-a") is not None
    assert bundle.loaded_at == loaded_at


def test_bundle_with_one_bad_key_among_good_ones_is_refused_whole(
    bundle: TrustBundle, bundle_path: Path, key_b: Ed25519PrivateKey
) -> None:
    write_atomically(bundle_path, jwks(_ok(key_b, "key-b"), {"kty": "RSA", "kid": "r"}))
    with pytest.raises(TokensvcError):
        bundle.reload()
    assert bundle.kids == ["key-a"]


def test_error_for_private_key_material_does_not_echo_it(bundle: TrustBundle, bundle_path: Path) -> None:
    secret = "SECRETSECRETSECRETSECRETSECRETSECRETSECRET0"
    write_atomically(bundle_path, jwks({"kty": "OKP", "crv": "Ed25519", "x": _X, "d": secret, "kid": "k"}))
    with pytest.raises(TokensvcError) as caught:
        bundle.reload()
    assert secret not in str(caught.value)


def test_missing_file_is_trust_bundle_invalid(tmp_path: Path) -> None:
    with pytest.raises(TokensvcError) as caught:
        TrustBundle(tmp_path / "absent.jwks").load()
    assert caught.value.reason is Reason.TRUST_BUNDLE_INVALID


def test_refresh_loads_an_unloaded_bundle(bundle_path: Path) -> None:
    trust = TrustBundle(bundle_path, clock=FakeClock())
    assert trust.refresh_if_changed() is True
    assert trust.kids == ["key-a"]


def test_refresh_picks_up_a_changed_file_only_after_the_check_interval(
    bundle: TrustBundle, bundle_path: Path, clock: FakeClock, key_b: Ed25519PrivateKey
) -> None:
    assert bundle.refresh_if_changed() is False  # first check: file unchanged since load
    write_atomically(bundle_path, jwks(_ok(key_b, "key-b")))
    clock.now += 0.5
    assert bundle.refresh_if_changed() is False  # inside the interval: not even a stat
    assert bundle.kids == ["key-a"]
    clock.now += 1.0
    assert bundle.refresh_if_changed() is True
    assert bundle.kids == ["key-b"]
    assert bundle.key("key-a") is None


def test_refresh_detects_a_replacement_with_same_size_and_mtime(
    bundle: TrustBundle, bundle_path: Path, clock: FakeClock, key_b: Ed25519PrivateKey
) -> None:
    before = bundle_path.stat()
    write_atomically(bundle_path, jwks(_ok(key_b, "key-z")))  # same length: kids are both 5 chars
    os.utime(bundle_path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = bundle_path.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert after.st_ino != before.st_ino
    clock.now += 2
    assert bundle.refresh_if_changed() is True
    assert bundle.kids == ["key-z"]


def test_generation_counts_successful_loads_only(
    bundle: TrustBundle, bundle_path: Path, key_b: Ed25519PrivateKey
) -> None:
    assert bundle.generation == 1
    write_atomically(bundle_path, "not json")
    with pytest.raises(TokensvcError):
        bundle.reload()
    assert bundle.generation == 1
    write_atomically(bundle_path, jwks(_ok(key_b, "key-b")))
    bundle.reload()
    assert bundle.generation == 2


def test_refresh_of_an_unchanged_file_does_not_reload(bundle: TrustBundle, clock: FakeClock) -> None:
    loaded_at = bundle.loaded_at
    for _ in range(3):
        clock.now += 5
        assert bundle.refresh_if_changed() is False
    assert bundle.loaded_at == loaded_at


def test_refresh_with_a_bad_file_logs_once_keeps_keys_then_recovers(
    bundle: TrustBundle,
    bundle_path: Path,
    clock: FakeClock,
    key_b: Ed25519PrivateKey,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="tokensvc.auth.keyset")
    bundle_path.write_text('{"keys": [{"kty": "OKP", "crv"')  # a half-written in-place edit
    for _ in range(3):
        clock.now += 2
        assert bundle.refresh_if_changed() is False
        assert bundle.kids == ["key-a"]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1  # reported once per file version, not once per second
    write_atomically(bundle_path, jwks(_ok(key_b, "key-b")))
    clock.now += 2
    assert bundle.refresh_if_changed() is True
    assert bundle.kids == ["key-b"]


def test_refresh_after_the_file_is_deleted_keeps_keys(
    bundle: TrustBundle, bundle_path: Path, clock: FakeClock
) -> None:
    bundle_path.unlink()
    clock.now += 2
    assert bundle.refresh_if_changed() is False
    assert bundle.kids == ["key-a"]
