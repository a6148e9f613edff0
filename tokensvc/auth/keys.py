"""Ed25519 signing keys as JWKs: reading a private JWK, its public JWK and RFC 7638 thumbprint.

Production code (the capability issuer) reads its signing key here; the dev PKI
(`tokensvc.auth.devpki`) creates keys in this format and uses the same functions.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

__all__ = ["b64url", "jwk_thumbprint", "load_signing_key", "public_jwk", "raw_public_key"]

_BASE64URL = re.compile(r"[A-Za-z0-9_-]*")


def jwk_thumbprint(public_key: Ed25519PublicKey) -> str:
    """RFC 7638 thumbprint: base64url SHA-256 of the required members in lexicographic order."""
    members = {"crv": "Ed25519", "kty": "OKP", "x": b64url(raw_public_key(public_key))}
    canonical = json.dumps(members, separators=(",", ":"), sort_keys=True)
    return b64url(hashlib.sha256(canonical.encode()).digest())


def public_jwk(public_key: Ed25519PublicKey, kid: str) -> dict[str, str]:
    return {
        "kty": "OKP",
        "crv": "Ed25519",
        "x": b64url(raw_public_key(public_key)),
        "kid": kid,
        "use": "sig",
        "alg": "EdDSA",
    }


def load_signing_key(path: Path) -> tuple[str, Ed25519PrivateKey]:
    """Read a private Ed25519 JWK; returns (kid, key). Errors never echo the private part."""
    try:
        jwk = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a JSON JWK") from exc
    if not isinstance(jwk, dict) or jwk.get("kty") != "OKP" or jwk.get("crv") != "Ed25519":
        raise ValueError(f"{path}: expected an OKP Ed25519 JWK")
    kid, x, d = jwk.get("kid"), jwk.get("x"), jwk.get("d")
    if not (isinstance(kid, str) and kid and isinstance(x, str) and isinstance(d, str)):
        raise ValueError(f"{path}: the JWK needs string members 'kid', 'x' and 'd'")
    raw = _b64url_decode(d)
    if raw is None or len(raw) != 32:
        raise ValueError(f"{path}: 'd' is not a base64url 32-byte Ed25519 private key")
    key = Ed25519PrivateKey.from_private_bytes(raw)
    if b64url(raw_public_key(key.public_key())) != x:
        raise ValueError(f"{path}: 'x' does not match the private key")
    return kid, key


def raw_public_key(public_key: Ed25519PublicKey) -> bytes:
    """The 32 raw bytes of an Ed25519 public key."""
    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def b64url(data: bytes) -> str:
    """Unpadded base64url (RFC 7515)."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64url_decode(text: str) -> bytes | None:
    if not _BASE64URL.fullmatch(text) or len(text) % 4 == 1:
        return None
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
