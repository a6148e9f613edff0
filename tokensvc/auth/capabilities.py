"""Run capabilities: compact JWS (JWT) tokens signed with Ed25519 that say what one run may touch.

Verification is PyJWT on strict settings plus checks PyJWT does not make: the token size and
shape, JSON nested at most 32 deep (before parsing), the header (`alg` from `ALLOWED_ALGORITHMS`,
`typ`, a known `kid`, no embedded keys or key URLs, no `crit`), and exact claim types — PyJWT
coerces time claims with `int()`, so `"1"`, `1.5` and `true` would pass it. The time claims are checked here against the injected clock.

Every refusal is `CapabilityInvalid` with the same message, except a token that is otherwise
valid but past `exp` (+ leeway), which is `CapabilityExpired`. Nothing about the token is logged.

`aud` must be the service's audience as a string or a one-element list: a token addressed to
several audiences could be replayed against each of them, so we do not accept one.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import re
import time
import unicodedata
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

import jwt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from tokensvc.auth.keyset import TrustBundle
from tokensvc.errors import CapabilityExpired, CapabilityInvalid, InvalidArgument
from tokensvc.names import DNS_LABEL, KB_REF
from tokensvc.untrusted_json import parse

__all__ = [
    "ALLOWED_ALGORITHMS",
    "CAPABILITY_TYPE",
    "MAX_LEEWAY_SECONDS",
    "MAX_TOKEN_BYTES",
    "MAX_USER_CHARS",
    "CapabilityVerifier",
    "VerifiedCapability",
    "certificate_thumbprint",
    "mint_capability",
]

# PyJWT registers Ed25519 only as "EdDSA" (no RFC 9864 "Ed25519" alias), so that is the only entry.
ALLOWED_ALGORITHMS: tuple[str, ...] = ("EdDSA",)
CAPABILITY_TYPE = "run-cap+jwt"
MAX_TOKEN_BYTES = 8192
MAX_LEEWAY_SECONDS = 60

_LOG = logging.getLogger(__name__)

_SEGMENT = r"[A-Za-z0-9_-]+"
_COMPACT_JWS = re.compile(rf"{_SEGMENT}\.{_SEGMENT}\.{_SEGMENT}")
# Headers that carry or point at a key: the key comes from our bundle, never from the token.
_FORBIDDEN_HEADERS = frozenset({"jwk", "jku", "x5u", "x5c", "x5t", "x5t#S256", "crit", "b64"})
_REQUIRED_CLAIMS = ("iss", "aud", "sub", "jti", "iat", "nbf", "exp", "ns", "agent")
_THUMBPRINT = re.compile(r"[A-Za-z0-9_-]{43}")
_MAX_ID_CHARS = 256
MAX_USER_CHARS = 512  # a capability's `user` claim: 1..512 characters (and what erasure accepts)
_MAX_KBS = 64
_MAX_NUMERIC_DATE = 253402300799  # 9999-12-31T23:59:59Z
_SHA256_BYTES = 32

_T = TypeVar("_T")


@dataclass(frozen=True)
class VerifiedCapability:
    """The claims of a capability that passed every check. The raw user id stays out of the repr."""

    run_id: str
    jti: str
    issuer: str
    namespace: str
    agent: str
    user: str | None = field(repr=False)
    per_user: bool
    registry: str | None
    long_term_memory: bool
    knowledge_bases: tuple[str, ...]
    issued_at: int
    not_before: int
    expires_at: int
    cnf_x5t_s256: str | None
    token_sha256: bytes = field(repr=False)


class _Reject(Exception):
    """Internal: a check failed; `category` is the coarse, loggable kind of failure."""

    def __init__(self, category: str) -> None:
        super().__init__(category)
        self.category = category


class CapabilityVerifier:
    """Verifies run capabilities against a trust bundle, issuer allow-list and audience."""

    def __init__(
        self,
        bundle: TrustBundle,
        *,
        issuers: Iterable[str],
        audience: str,
        max_lifetime_seconds: int,
        leeway_seconds: int = 30,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not 0 <= leeway_seconds <= MAX_LEEWAY_SECONDS:
            raise ValueError(f"leeway_seconds must be between 0 and {MAX_LEEWAY_SECONDS}")
        if max_lifetime_seconds <= 0:
            raise ValueError("max_lifetime_seconds must be positive")
        self._issuers = frozenset(issuers)
        if not self._issuers or not all(isinstance(i, str) and i for i in self._issuers):
            raise ValueError("issuers must be a non-empty list of non-empty strings")
        if not audience:
            raise ValueError("audience must be a non-empty string")
        self._bundle = bundle
        self._audience = audience
        self._max_lifetime = max_lifetime_seconds
        self._leeway = leeway_seconds
        self._clock = clock
        # Time claims are checked below against our clock; PyJWT's own checks use the wall clock
        # and coerce types, so they are off. Presence, iss, aud, sub and jti types are left on.
        self._jwt = jwt.PyJWT(
            options={
                "verify_signature": True,
                "verify_exp": False,
                "verify_nbf": False,
                "verify_iat": False,
                "verify_aud": True,
                "verify_iss": True,
                "verify_sub": True,
                "verify_jti": True,
                "require": list(_REQUIRED_CLAIMS),
                "strict_aud": False,
                "enforce_minimum_key_length": True,
            }
        )

    def verify(self, token: str) -> VerifiedCapability:
        """The verified claims; raises CapabilityExpired or CapabilityInvalid (nothing else)."""
        try:
            return self._verify(token)
        except _Reject as rejected:
            _LOG.debug("run capability rejected", extra={"category": rejected.category})
            if rejected.category == "expired":
                raise CapabilityExpired() from None
            raise CapabilityInvalid() from None

    def _verify(self, token: str) -> VerifiedCapability:
        # Size and shape before any decoding: a cheap refusal for junk of any size.
        if not isinstance(token, str) or len(token) > MAX_TOKEN_BYTES or not token.isascii():
            raise _Reject("format")
        if not _COMPACT_JWS.fullmatch(token):
            raise _Reject("format")
        _require_strict_json(token)
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise _Reject("format") from None
        key = self._bundle_key(header)
        try:
            decoded = self._jwt.decode_complete(
                token,
                key,
                algorithms=list(ALLOWED_ALGORITHMS),
                audience=self._audience,
                issuer=self._issuers,
            )
        except jwt.PyJWTError:
            raise _Reject("signature-or-claims") from None
        return self._claims(decoded["payload"], hashlib.sha256(token.encode("ascii")).digest())

    def _bundle_key(self, header: dict[str, Any]) -> Ed25519PublicKey:
        if header.get("alg") not in ALLOWED_ALGORITHMS or header.get("typ") != CAPABILITY_TYPE:
            raise _Reject("header")
        if header.keys() & _FORBIDDEN_HEADERS:
            raise _Reject("header")
        kid = header.get("kid")
        if not isinstance(kid, str) or not kid:
            raise _Reject("header")
        self._bundle.refresh_if_changed()
        key = self._bundle.key(kid)
        if key is None:
            raise _Reject("unknown-kid")
        return key

    def _claims(self, claims: dict[str, Any], token_sha256: bytes) -> VerifiedCapability:
        aud = claims["aud"]
        if aud not in (self._audience, [self._audience]):
            raise _Reject("claims")
        iat, nbf, exp = (_numeric_date(claims[name]) for name in ("iat", "nbf", "exp"))
        user = _optional(claims, "user", _text(MAX_USER_CHARS))
        per_user = _optional(claims, "per_user", _flag) or False
        if per_user and user is None:
            raise _Reject("claims")
        capability = VerifiedCapability(
            run_id=_identifier(_MAX_ID_CHARS)(claims["sub"]),
            jti=_identifier(_MAX_ID_CHARS)(claims["jti"]),
            issuer=claims["iss"],
            namespace=_dns_label(claims["ns"]),
            agent=_dns_label(claims["agent"]),
            user=user,
            per_user=per_user,
            registry=_optional(claims, "registry", _dns_label),
            long_term_memory=_optional(claims, "ltm", _flag) or False,
            knowledge_bases=_optional(claims, "kbs", _kb_refs) or (),
            issued_at=iat,
            not_before=nbf,
            expires_at=exp,
            cnf_x5t_s256=_optional(claims, "cnf", _confirmation),
            token_sha256=token_sha256,
        )
        now = self._clock()
        if exp <= iat or exp - iat > self._max_lifetime or nbf >= exp:
            raise _Reject("lifetime")
        if iat > now + self._leeway or nbf > now + self._leeway:
            raise _Reject("not-yet-valid")
        # Last, so an expired token that is also forged or malformed still reads as invalid.
        if exp <= now - self._leeway:
            raise _Reject("expired")
        return capability


def _require_strict_json(token: str) -> None:
    """Header and payload are UTF-8 JSON objects with no repeated key (RFC 7519 section 7.2),
    nested at most `untrusted_json.MAX_DEPTH` deep (checked before parsing).

    PyJWT's parser also takes UTF-16 and keeps the last of repeated keys; a signer and a verifier
    must never read one token differently, so both are refused before PyJWT decodes it.
    """
    for segment in token.split(".")[:2]:
        try:
            raw = base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4))
            value = parse(raw, max_bytes=MAX_TOKEN_BYTES, object_pairs_hook=_unique_keys)
        except (ValueError, binascii.Error):  # UntrustedJsonError and _unique_keys' are ValueErrors
            raise _Reject("format") from None
        if not isinstance(value, dict):
            raise _Reject("format")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("a repeated key")
    return dict(pairs)


def _fail() -> NoReturn:
    raise _Reject("claims")


def _optional(claims: dict[str, Any], name: str, check: Callable[[object], _T]) -> _T | None:
    """An absent or null optional claim is None; a present one must pass `check`."""
    value = claims.get(name)
    return None if value is None else check(value)


def _numeric_date(value: object) -> int:
    # Integers only: bool is an int subclass, floats may be NaN/inf, and huge values overflow
    # datetime arithmetic downstream.
    if type(value) is not int or not 0 <= value <= _MAX_NUMERIC_DATE:
        _fail()
    return value


def _text(max_chars: int) -> Callable[[object], str]:
    """A string of 1..max_chars characters that PostgreSQL text and protobuf can hold: no U+0000,
    no lone surrogate (JSON's `\\ud800` escapes make them; UTF-8 cannot encode them)."""

    def check(value: object) -> str:
        if not isinstance(value, str) or not 0 < len(value) <= max_chars or "\x00" in value:
            _fail()
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            _fail()
        return value

    return check


_INVISIBLE = frozenset({"Zs", "Zl", "Zp", "Cc", "Cf"})


def _identifier(max_chars: int) -> Callable[[object], str]:
    """`_text` with at least one visible character: RevokeCapability accepts it (so every
    accepted capability can be revoked by its `jti` and its run id), and an operator can read it
    in a log line or an audit event (an id of only U+200B or U+202E would show as nothing)."""
    text = _text(max_chars)

    def check(value: object) -> str:
        checked = text(value)
        if all(unicodedata.category(ch) in _INVISIBLE for ch in checked):
            _fail()
        return checked

    return check


def _flag(value: object) -> bool:
    if not isinstance(value, bool):
        _fail()
    return value


def _dns_label(value: object) -> str:
    if not isinstance(value, str) or not DNS_LABEL.fullmatch(value):
        _fail()
    return value


def _kb_refs(value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > _MAX_KBS:
        _fail()
    refs = tuple(value)
    # Types first: a nested list is unhashable and would escape set() as a TypeError.
    if not all(isinstance(r, str) and KB_REF.fullmatch(r) for r in refs) or len(set(refs)) != len(refs):
        _fail()
    return refs


def _confirmation(value: object) -> str:
    if not isinstance(value, dict) or value.keys() != {"x5t#S256"}:
        _fail()
    thumbprint = value["x5t#S256"]
    if not _is_thumbprint(thumbprint):
        _fail()
    return str(thumbprint)


def _is_thumbprint(value: object) -> bool:
    """43 base64url characters that are the canonical encoding of 32 bytes."""
    if not isinstance(value, str) or not _THUMBPRINT.fullmatch(value):
        return False
    return _b64url(base64.urlsafe_b64decode(value + "=")) == value


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def certificate_thumbprint(der_or_sha256: bytes) -> str:
    """RFC 8705 `x5t#S256`: unpadded base64url of the SHA-256 of a DER certificate.

    A 32-byte argument is taken as that digest already (what `Caller.certificate_sha256` holds);
    no DER certificate is that short, so the two cannot be confused.
    """
    digest = der_or_sha256 if len(der_or_sha256) == _SHA256_BYTES else hashlib.sha256(der_or_sha256).digest()
    return _b64url(digest)


def mint_capability(
    private_key: Ed25519PrivateKey,
    kid: str,
    *,
    issuer: str,
    audience: str,
    namespace: str,
    agent: str,
    run_id: str | None = None,
    user: str | None = None,
    per_user: bool = False,
    registry: str | None = None,
    long_term_memory: bool = False,
    knowledge_bases: Sequence[str] = (),
    ttl_seconds: int = 3600,
    cnf_x5t_s256: str | None = None,
    now: float | None = None,
    jti: str | None = None,
) -> str:
    """Sign a capability in the documented format; raises InvalidArgument (naming the parameter)
    for a value that `CapabilityVerifier` would refuse, so a minted token is always well-formed."""
    run_id = run_id if run_id is not None else str(uuid.uuid4())
    jti = jti if jti is not None else str(uuid.uuid4())
    iat = int(time.time() if now is None else now)
    _require(bool(kid), "kid", "must not be empty")
    _require(bool(issuer) and bool(audience), "issuer", "issuer and audience must not be empty")
    _require(
        0 < len(run_id) <= _MAX_ID_CHARS and bool(run_id.strip()),
        "run_id",
        f"must be 1-{_MAX_ID_CHARS} characters",
    )
    _require(
        0 < len(jti) <= _MAX_ID_CHARS and bool(jti.strip()), "jti", f"must be 1-{_MAX_ID_CHARS} characters"
    )
    _require(bool(DNS_LABEL.fullmatch(namespace)), "namespace", "must be a DNS label")
    _require(bool(DNS_LABEL.fullmatch(agent)), "agent", "must be a DNS label")
    _require(registry is None or bool(DNS_LABEL.fullmatch(registry)), "registry", "must be a DNS label")
    _require(
        user is None or 0 < len(user) <= MAX_USER_CHARS, "user", f"must be 1-{MAX_USER_CHARS} characters"
    )
    _require(not per_user or user is not None, "user", "is required when per_user is set")
    kbs = list(knowledge_bases)
    _require(
        len(kbs) <= _MAX_KBS and len(set(kbs)) == len(kbs) and all(KB_REF.fullmatch(r) for r in kbs),
        "knowledge_bases",
        f"must be at most {_MAX_KBS} distinct knowledge-base refs",
    )
    _require(type(ttl_seconds) is int and ttl_seconds > 0, "ttl_seconds", "must be a positive integer")
    _require(cnf_x5t_s256 is None or _is_thumbprint(cnf_x5t_s256), "cnf_x5t_s256", "must be an x5t#S256")
    _require(iat >= 0 and iat + ttl_seconds <= _MAX_NUMERIC_DATE, "now", "is out of range")
    claims: dict[str, Any] = {
        "iss": issuer,
        "aud": audience,
        "sub": run_id,
        "jti": jti,
        "iat": iat,
        "nbf": iat,
        "exp": iat + ttl_seconds,
        "ns": namespace,
        "agent": agent,
        "per_user": per_user,
        "ltm": long_term_memory,
        "kbs": kbs,
    }
    if user is not None:
        claims["user"] = user
    if registry is not None:
        claims["registry"] = registry
    if cnf_x5t_s256 is not None:
        claims["cnf"] = {"x5t#S256": cnf_x5t_s256}
    return jwt.encode(
        claims, private_key, algorithm=ALLOWED_ALGORITHMS[0], headers={"typ": CAPABILITY_TYPE, "kid": kid}
    )


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise InvalidArgument(name, message)
