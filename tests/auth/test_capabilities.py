"""Run capabilities: every attack the issue lists, tried against the verifier and refused."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import os
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import json_parsed
from tokensvc.auth.capabilities import (
    CAPABILITY_TYPE,
    MAX_TOKEN_BYTES,
    CapabilityVerifier,
    VerifiedCapability,
    certificate_thumbprint,
    mint_capability,
)
from tokensvc.auth.devpki import public_jwk
from tokensvc.auth.keyset import TrustBundle
from tokensvc.errors import CapabilityExpired, CapabilityInvalid, InvalidArgument, Reason

NOW = 1_800_000_000
ISSUER = "spiffe://dev.local/ctxmesh/control-plane"
AUDIENCE = "tokensvc"
KID = "key-1"
LEEWAY = 30
MAX_LIFETIME = 7200
THUMBPRINT = certificate_thumbprint(b"a DER certificate stands here")


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def segment(value: Any) -> str:
    return b64(value if isinstance(value, bytes) else json.dumps(value).encode())


def sign_raw(header: Any, payload: Any, key: Ed25519PrivateKey) -> str:
    """A compact JWS with an arbitrary header and payload and a genuine Ed25519 signature."""
    signing_input = f"{segment(header)}.{segment(payload)}"
    return f"{signing_input}.{b64(key.sign(signing_input.encode()))}"


def header(**extra: Any) -> dict[str, Any]:
    return {"alg": "EdDSA", "typ": CAPABILITY_TYPE, "kid": KID, **extra}


def claims(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "iss": ISSUER,
        "aud": AUDIENCE,
        "sub": "run-1",
        "jti": "jti-1",
        "iat": NOW,
        "nbf": NOW,
        "exp": NOW + 600,
        "ns": "default",
        "agent": "dev-agent",
        "user": "alice@example.com",
        "per_user": True,
        "registry": "support",
        "ltm": True,
        "kbs": ["handbook", "faq.v2"],
        "cnf": {"x5t#S256": THUMBPRINT},
    }
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not _ABSENT}


_ABSENT = object()


def write_bundle(path: Path, **keys: Ed25519PrivateKey) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"keys": [public_jwk(k.public_key(), kid) for kid, k in keys.items()]}))
    os.replace(tmp, path)


@pytest.fixture
def signing_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(NOW + 10)


@pytest.fixture
def bundle_clock() -> FakeClock:
    return FakeClock(0)


@pytest.fixture
def bundle_path(tmp_path: Path, signing_key: Ed25519PrivateKey) -> Path:
    path = tmp_path / "trust-bundle.jwks"
    write_bundle(path, **{KID: signing_key})
    return path


@pytest.fixture
def bundle(bundle_path: Path, bundle_clock: FakeClock) -> TrustBundle:
    trust = TrustBundle(bundle_path, check_interval=1.0, clock=bundle_clock)
    trust.load()
    return trust


@pytest.fixture
def verifier(bundle: TrustBundle, clock: FakeClock) -> CapabilityVerifier:
    return CapabilityVerifier(
        bundle,
        issuers=[ISSUER, "other-issuer"],
        audience=AUDIENCE,
        max_lifetime_seconds=MAX_LIFETIME,
        leeway_seconds=LEEWAY,
        clock=clock,
    )


def assert_invalid(verifier: CapabilityVerifier, token: str) -> None:
    with pytest.raises(CapabilityInvalid) as caught:
        verifier.verify(token)
    assert caught.value.reason is Reason.CAPABILITY_INVALID
    assert caught.value.message == "the run capability was not accepted"  # never which check


# --- what is accepted -------------------------------------------------------------------------


def test_minted_capability_verifies_with_every_claim(
    verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey
) -> None:
    token = mint_capability(
        signing_key,
        KID,
        issuer=ISSUER,
        audience=AUDIENCE,
        namespace="team-a",
        agent="helper",
        run_id="run-42",
        user="bob",
        per_user=True,
        registry="support",
        long_term_memory=True,
        knowledge_bases=["kb-1", "kb.two"],
        ttl_seconds=900,
        cnf_x5t_s256=THUMBPRINT,
        now=NOW,
        jti="jti-42",
    )
    assert jwt.get_unverified_header(token) == {"alg": "EdDSA", "typ": "run-cap+jwt", "kid": KID}
    assert verifier.verify(token) == VerifiedCapability(
        run_id="run-42",
        jti="jti-42",
        issuer=ISSUER,
        namespace="team-a",
        agent="helper",
        user="bob",
        per_user=True,
        registry="support",
        long_term_memory=True,
        knowledge_bases=("kb-1", "kb.two"),
        issued_at=NOW,
        not_before=NOW,
        expires_at=NOW + 900,
        cnf_x5t_s256=THUMBPRINT,
        token_sha256=hashlib.sha256(token.encode()).digest(),
    )


def test_minted_capability_defaults_generate_ids_and_omit_optional_claims(
    verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey
) -> None:
    token = mint_capability(
        signing_key, KID, issuer=ISSUER, audience=AUDIENCE, namespace="default", agent="a", now=NOW
    )
    payload = jwt.decode(token, options={"verify_signature": False})
    assert {"user", "registry", "cnf"}.isdisjoint(payload)
    verified = verifier.verify(token)
    assert verified.run_id != verified.jti
    assert len(verified.run_id) == len(verified.jti) == 36  # uuid4
    assert (verified.user, verified.per_user, verified.registry) == (None, False, None)
    assert (verified.long_term_memory, verified.knowledge_bases, verified.cnf_x5t_s256) == (False, (), None)
    assert verified.expires_at == NOW + 3600


def test_token_from_plain_pyjwt_with_documented_claims_verifies(
    verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey
) -> None:
    token = jwt.encode(claims(), signing_key, algorithm="EdDSA", headers={"typ": "run-cap+jwt", "kid": KID})
    verified = verifier.verify(token)
    assert (verified.namespace, verified.agent, verified.user) == (
        "default",
        "dev-agent",
        "alice@example.com",
    )
    assert verified.knowledge_bases == ("handbook", "faq.v2")


def test_minimal_claims_verify_with_defaults(
    verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey
) -> None:
    minimal = claims(user=_ABSENT, per_user=_ABSENT, registry=_ABSENT, ltm=_ABSENT, kbs=_ABSENT, cnf=_ABSENT)
    verified = verifier.verify(sign_raw(header(), minimal, signing_key))
    assert (verified.per_user, verified.long_term_memory, verified.knowledge_bases) == (False, False, ())


def test_null_optional_claims_count_as_absent(
    verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey
) -> None:
    token = sign_raw(header(), claims(user=None, per_user=None, registry=None, cnf=None), signing_key)
    verified = verifier.verify(token)
    assert (verified.user, verified.per_user, verified.registry, verified.cnf_x5t_s256) == (
        None,
        False,
        None,
        None,
    )


def test_unknown_extra_claims_are_ignored(
    verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey
) -> None:
    assert verifier.verify(sign_raw(header(), claims(extra={"x": [1]}, scope="admin"), signing_key))


def test_audience_as_one_element_list_is_accepted(
    verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey
) -> None:
    assert verifier.verify(sign_raw(header(), claims(aud=[AUDIENCE]), signing_key))


def test_token_just_under_the_size_limit_verifies(
    verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey
) -> None:
    token = sign_raw(header(), claims(pad=""), signing_key)
    pad = (MAX_TOKEN_BYTES - len(token)) * 3 // 4
    token = sign_raw(header(), claims(pad="p" * pad), signing_key)
    assert MAX_TOKEN_BYTES - 4 <= len(token) <= MAX_TOKEN_BYTES
    assert verifier.verify(token)


def test_repr_of_verified_capability_hides_the_user_id(
    verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey
) -> None:
    verified = verifier.verify(sign_raw(header(), claims(user="alice-7d1f@example.com"), signing_key))
    assert verified.user == "alice-7d1f@example.com"
    assert "alice-7d1f" not in repr(verified)
    assert "alice-7d1f" not in str(verified)


# --- header attacks ---------------------------------------------------------------------------


# Includes "Ed25519" (RFC 9864's name): PyJWT has no such alias, so it is not on our allow-list.
NONE_ALGS = ["none", "None", "NONE", "nOnE", "", None]
OTHER_ALGS = ["HS256", "HS512", "RS256", "ES256", "PS256", "Ed25519", "eddsa"]


@pytest.mark.parametrize("alg", [*NONE_ALGS, *OTHER_ALGS])
def test_algorithm_outside_the_allow_list_is_refused_even_with_a_valid_signature(
    verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey, alg: str | None
) -> None:
    assert_invalid(verifier, sign_raw(header(alg=alg), claims(), signing_key))


def test_missing_alg_is_refused(verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey) -> None:
    bare = header()
    del bare["alg"]
    assert_invalid(verifier, sign_raw(bare, claims(), signing_key))


@pytest.mark.parametrize("alg", ["none", "None", "NONE"])
def test_unsigned_alg_none_token_is_refused(verifier: CapabilityVerifier, alg: str) -> None:
    unsigned = f"{segment(header(alg=alg))}.{segment(claims())}"
    assert_invalid(verifier, unsigned + ".")
    assert_invalid(verifier, unsigned)
    assert_invalid(verifier, unsigned + "." + b64(b"x"))


@pytest.mark.parametrize("secret_form", ["raw", "pem", "jwk-x"])
def test_hs256_token_signed_with_the_public_key_as_hmac_secret_is_refused(
    verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey, secret_form: str
) -> None:
    public = signing_key.public_key()
    secret = {
        "raw": public.public_bytes(Encoding.Raw, PublicFormat.Raw),
        "pem": public.public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo),
        "jwk-x": public_jwk(public, KID)["x"].encode(),
    }[secret_form]
    signing_input = f"{segment(header(alg='HS256'))}.{segment(claims())}"
    mac = hmac.new(secret, signing_input.encode(), hashlib.sha256).digest()
    assert_invalid(verifier, f"{signing_input}.{b64(mac)}")


@pytest.mark.parametrize(
    "extra",
    [
        {"jwk": {"kty": "OKP", "crv": "Ed25519", "x": "placeholder"}},
        {"jku": "https://attacker.example/jwks.json"},
        {"x5u": "https://attacker.example/cert.pem"},
        {"x5c": ["MIIBszCCAVmgAwIBAgIU"]},
        {"x5t": "dGh1bWI"},
        {"x5t#S256": THUMBPRINT},
    ],
    ids=lambda extra: next(iter(extra)),
)
def test_embedded_key_headers_are_refused_even_with_a_valid_signature(
    verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey, extra: dict[str, Any]
) -> None:
    if "jwk" in extra:  # the attacker embeds the very key that signed the token
        extra = {"jwk": public_jwk(signing_key.public_key(), KID)}
    assert_invalid(verifier, sign_raw(header(**extra), claims(), signing_key))


@pytest.mark.parametrize(
    "extra",
    [
        {"crit": ["exp-ext"], "exp-ext": 1},
        {"crit": ["b64"], "b64": True},  # one PyJWT itself understands: we still understand none
        {"crit": []},
        {"crit": "exp-ext"},
        {"b64": False},
    ],
    ids=["unknown", "b64", "empty", "not-a-list", "b64-without-crit"],
)
def test_crit_header_is_refused(
    verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey, extra: dict[str, Any]
) -> None:
    assert_invalid(verifier, sign_raw(header(**extra), claims(), signing_key))


@pytest.mark.parametrize("typ", [None, "JWT", "jwt", "RUN-CAP+JWT", "application/run-cap+jwt", "at+jwt", 1])
def test_wrong_typ_is_refused(
    verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey, typ: object
) -> None:
    assert_invalid(verifier, sign_raw(header(typ=typ), claims(), signing_key))


@pytest.mark.parametrize("kid", [None, "", 7, ["key-1"], {"kid": "key-1"}, "key-2"])
def test_missing_wrong_type_or_unknown_kid_is_refused(
    verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey, kid: object
) -> None:
    assert_invalid(verifier, sign_raw(header(kid=kid), claims(), signing_key))


def test_valid_signature_from_a_key_outside_the_bundle_under_a_known_kid_is_refused(
    verifier: CapabilityVerifier,
) -> None:
    impostor = Ed25519PrivateKey.generate()
    assert_invalid(
        verifier,
        mint_capability(
            impostor, KID, issuer=ISSUER, audience=AUDIENCE, namespace="default", agent="a", now=NOW
        ),
    )


def test_tampered_payload_is_refused(verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey) -> None:
    token = sign_raw(header(), claims(), signing_key)
    head, _, signature = token.split(".")
    assert_invalid(verifier, f"{head}.{segment(claims(ns='other'))}.{signature}")


# --- key rotation through the bundle ----------------------------------------------------------


def test_key_removed_from_the_bundle_stops_verifying_after_reload(
    verifier: CapabilityVerifier,
    signing_key: Ed25519PrivateKey,
    bundle_path: Path,
    bundle_clock: FakeClock,
) -> None:
    token = sign_raw(header(), claims(), signing_key)
    assert verifier.verify(token)
    new_key = Ed25519PrivateKey.generate()
    write_bundle(bundle_path, **{"key-2": new_key})
    bundle_clock.now += 1.5  # past check_interval: the verifier's own refresh notices the change
    assert_invalid(verifier, token)
    assert verifier.verify(sign_raw(header(kid="key-2"), claims(), new_key))


def test_malformed_bundle_update_keeps_verifying_with_previous_keys(
    verifier: CapabilityVerifier,
    signing_key: Ed25519PrivateKey,
    bundle_path: Path,
    bundle_clock: FakeClock,
) -> None:
    bundle_path.write_text('{"keys": [')
    bundle_clock.now += 5
    assert verifier.verify(sign_raw(header(), claims(), signing_key))


# --- malformed tokens -------------------------------------------------------------------------


def test_token_over_8_kib_is_refused(verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey) -> None:
    token = sign_raw(header(), claims(pad="p" * MAX_TOKEN_BYTES), signing_key)
    assert_invalid(verifier, token)
    assert_invalid(verifier, "a" * 10_000_000)


@pytest.mark.parametrize(
    "shape",
    [
        "{h}.{p}",
        "{h}.{p}.{s}.{s}",
        "{h}.{p}.{s}.",
        "{h}",
        "",
        ".{p}.{s}",
        "{h}..{s}",
        "{h}.{p}.",
        "..",
        "{h}.{p}.{s}=",
        "{h}=.{p}.{s}",
        "{h}.{p}.!!!!",
        "{h}.{p}.{s}+",
        "{h}.{p}/.{s}",
        " {h}.{p}.{s}",
        "{h}.{p}.{s}\n",
        "{h}.{p}.{s}A",
        "{h}.{p}.A{s}",
        "Bearer {h}.{p}.{s}",
        "{h}.{p}.{s}é",
    ],
)
def test_malformed_compact_serialisation_is_refused(
    verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey, shape: str
) -> None:
    h, p, s = sign_raw(header(), claims(), signing_key).split(".")
    assert_invalid(verifier, shape.format(h=h, p=p, s=s))


@pytest.mark.parametrize("where", ["header", "payload"])
@pytest.mark.parametrize(
    "content",
    [
        b"[]",
        b'["alg"]',
        b'"a string"',
        b"42",
        b"null",
        b"true",
        b"not json",
        b"\xff\xfe{}",
        b"",
        b"[" * 2500 + b"]" * 2500,
    ],
    ids=["empty-array", "array", "string", "number", "null", "bool", "garbage", "not-utf8", "empty", "deep"],
)
def test_segment_that_is_not_a_json_object_is_refused(
    verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey, where: str, content: bytes
) -> None:
    token = (
        sign_raw(content, claims(), signing_key)
        if where == "header"
        else sign_raw(header(), content, signing_key)
    )
    assert_invalid(verifier, token)


def with_member(document: dict[str, Any], raw: str) -> bytes:
    """`document` as JSON with one more member, `x`, whose value is the JSON text `raw`."""
    return (json.dumps(document)[:-1] + f', "x": {raw}}}').encode()


@pytest.mark.parametrize("where", ["header", "payload"])
@pytest.mark.parametrize("depth", [40, 100, 900])
def test_a_capability_nested_deeper_than_the_bound_is_refused_before_it_is_parsed(
    verifier: CapabilityVerifier,
    signing_key: Ed25519PrivateKey,
    monkeypatch: pytest.MonkeyPatch,
    where: str,
    depth: int,
) -> None:
    # Issue 35: a signed token whose header or payload nests deeper than 32 levels. Left to the
    # parser, whether it passed depended on how deep the caller's stack already was.
    nested = "[" * depth + "]" * depth
    token = (
        sign_raw(with_member(header(), nested), claims(), signing_key)
        if where == "header"
        else sign_raw(header(), with_member(claims(), nested), signing_key)
    )
    parsed = json_parsed(monkeypatch)
    assert_invalid(verifier, token)
    assert not [document for document in parsed if nested in document]


def test_an_extra_claim_nested_a_few_levels_is_accepted(
    verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey
) -> None:
    assert verifier.verify(sign_raw(header(), with_member(claims(), "[" * 8 + "]" * 8), signing_key))


def test_non_string_token_is_refused(verifier: CapabilityVerifier) -> None:
    assert_invalid(verifier, b"a.b.c")  # type: ignore[arg-type]
    assert_invalid(verifier, None)  # type: ignore[arg-type]


# --- claims -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["iss", "aud", "sub", "jti", "iat", "nbf", "exp", "ns", "agent"])
def test_missing_required_claim_is_refused(
    verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey, name: str
) -> None:
    assert_invalid(verifier, sign_raw(header(), claims(**{name: _ABSENT}), signing_key))
    assert_invalid(verifier, sign_raw(header(), claims(**{name: None}), signing_key))


BAD_TIMES: dict[str, object] = {
    "string": str(NOW + 60),
    "negative": -1,
    "inf": float("inf"),
    "-inf": float("-inf"),
    "nan": float("nan"),
    "1e20": 10**20,
    "2**64": 2**64,
    "true": True,
    "false": False,
    "fraction": NOW + 60.5,
    "integral-float": float(NOW + 60),
    "list": [NOW],
    "object": {"t": NOW},
    "year-10000": 253402300800,
}


@pytest.mark.parametrize("value", BAD_TIMES.values(), ids=BAD_TIMES.keys())
@pytest.mark.parametrize("name", ["iat", "nbf", "exp"])
def test_time_claim_of_wrong_type_or_range_is_refused(
    verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey, name: str, value: object
) -> None:
    assert_invalid(verifier, sign_raw(header(), claims(**{name: value}), signing_key))


@pytest.mark.parametrize(
    "overrides",
    [
        {"iss": "https://attacker.example"},
        {"iss": ISSUER.upper()},
        {"iss": [ISSUER]},
        {"aud": "other-service"},
        {"aud": [AUDIENCE, "other-service"]},
        {"aud": []},
        {"aud": ""},
        {"aud": {"aud": AUDIENCE}},
        {"aud": [[AUDIENCE]]},
        {"sub": ""},
        {"sub": 42},
        {"sub": "r" * 257},
        {"jti": ""},
        {"jti": ["j"]},
        {"jti": "j" * 257},
    ],
    ids=repr,
)
def test_wrong_issuer_audience_subject_or_jti_is_refused(
    verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey, overrides: dict[str, Any]
) -> None:
    assert_invalid(verifier, sign_raw(header(), claims(**overrides), signing_key))


@pytest.mark.parametrize(
    "value", ["Default", "-team", "team-", "a" * 64, "a_b", "a.b", "", "a\n", "ü", 5, ["a"]]
)
@pytest.mark.parametrize("name", ["ns", "agent", "registry"])
def test_namespace_agent_or_registry_that_is_not_a_dns_label_is_refused(
    verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey, name: str, value: object
) -> None:
    assert_invalid(verifier, sign_raw(header(), claims(**{name: value}), signing_key))


@pytest.mark.parametrize(
    "overrides",
    [
        {"per_user": True, "user": _ABSENT},
        {"per_user": True, "user": None},
        {"user": ""},
        {"user": "u" * 513},
        {"user": 42},
        {"per_user": 1},
        {"per_user": "true"},
        {"ltm": "yes"},
        {"ltm": 0},
        {"kbs": "handbook"},
        {"kbs": ["handbook", "handbook"]},
        {"kbs": [f"kb-{i}" for i in range(65)]},
        {"kbs": ["Handbook"]},
        {"kbs": ["kb/../other"]},
        {"kbs": [7]},
        {"kbs": [[]]},  # found by hypothesis: unhashable items once escaped as TypeError
        {"kbs": {"handbook": True}},
        {"cnf": THUMBPRINT},
        {"cnf": {}},
        {"cnf": {"x5t#S256": THUMBPRINT, "jkt": "x"}},
        {"cnf": {"x5t#S256": THUMBPRINT[:-1]}},
        {"cnf": {"x5t#S256": THUMBPRINT + "="}},
        {"cnf": {"x5t#S256": THUMBPRINT[:-1] + "B"}},  # 43 chars but not a canonical 32-byte encoding
        {"cnf": {"x5t#S256": 5}},
    ],
    ids=repr,
)
def test_malformed_scope_claim_is_refused(
    verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey, overrides: dict[str, Any]
) -> None:
    assert_invalid(verifier, sign_raw(header(), claims(**overrides), signing_key))


@pytest.mark.parametrize(
    "overrides",
    [
        # Whitespace-only ids cannot be revoked (RevokeCapability refuses them): never accepted.
        {"jti": " "},
        {"sub": "\t\n"},
        # Only invisible characters (format, separators, controls): nothing to read in a log line.
        {"jti": "\u200b"},
        {"jti": "\u202e\u200d"},
        {"sub": "\u2028\u00a0"},
        # PostgreSQL text cannot hold NUL; UTF-8 (protobuf, the bucket HMAC) cannot hold a lone surrogate.
        {"jti": "id\x00"},
        {"sub": "run\x00"},
        {"jti": "id-\ud800"},
        {"sub": "run-\udfff"},
        {"user": "carol\ud800", "per_user": True},
        {"user": "carol\x00", "per_user": True},
    ],
    ids=repr,
)
def test_an_identifier_the_service_could_not_store_or_revoke_is_refused(
    verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey, overrides: dict[str, Any]
) -> None:
    assert_invalid(verifier, sign_raw(header(), claims(**overrides), signing_key))


@pytest.mark.parametrize("value", ["a\u200b", "\u202eid", "é", "😀", "x y"])
def test_an_identifier_with_a_visible_character_is_accepted(
    verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey, value: str
) -> None:
    verified = verifier.verify(sign_raw(header(), claims(jti=value, sub=value), signing_key))
    assert (verified.jti, verified.run_id) == (value, value)


def test_a_payload_in_utf16_is_refused_though_signed(
    verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey
) -> None:
    payload = json.dumps(claims()).encode("utf-16")
    assert json.loads(payload) == claims()  # Python's parser would read it
    assert_invalid(verifier, sign_raw(header(), payload, signing_key))


@pytest.mark.parametrize("where", ["header", "payload"])
def test_a_repeated_key_is_refused_though_signed(
    verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey, where: str
) -> None:
    good_header, good_claims = json.dumps(header()), json.dumps(claims())
    if where == "header":  # even a repeat of the same value: one token, one reading
        raw_header, raw_claims = good_header[:-1] + ', "alg": "EdDSA"}', good_claims
    else:  # the second "ns" would win with a lenient parser
        raw_header, raw_claims = good_header, good_claims[:-1] + ', "ns": "team-b"}'
    token = sign_raw(raw_header.encode(), raw_claims.encode(), signing_key)
    assert_invalid(verifier, token)
    # The same token without the repetition verifies: only the repetition is refused.
    assert verifier.verify(sign_raw(good_header.encode(), good_claims.encode(), signing_key))


def test_sixty_four_distinct_knowledge_bases_are_accepted(
    verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey
) -> None:
    kbs = [f"kb-{i}" for i in range(64)]
    assert verifier.verify(sign_raw(header(), claims(kbs=kbs), signing_key)).knowledge_bases == tuple(kbs)


# --- time -------------------------------------------------------------------------------------


def test_expired_beyond_leeway_is_capability_expired(
    verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey, clock: FakeClock
) -> None:
    token = sign_raw(header(), claims(exp=NOW + 600), signing_key)
    clock.now = NOW + 600 + LEEWAY
    with pytest.raises(CapabilityExpired) as caught:
        verifier.verify(token)
    assert caught.value.reason is Reason.CAPABILITY_EXPIRED


def test_expired_within_leeway_is_accepted(
    verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey, clock: FakeClock
) -> None:
    token = sign_raw(header(), claims(exp=NOW + 600), signing_key)
    clock.now = NOW + 600 + LEEWAY - 1
    assert verifier.verify(token)


def test_expired_token_that_is_also_forged_is_invalid_not_expired(
    verifier: CapabilityVerifier, clock: FakeClock
) -> None:
    clock.now = NOW + 10_000
    assert_invalid(verifier, sign_raw(header(), claims(), Ed25519PrivateKey.generate()))


@pytest.mark.parametrize("name", ["nbf", "iat"])
def test_not_yet_valid_beyond_leeway_is_refused(
    verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey, clock: FakeClock, name: str
) -> None:
    clock.now = NOW - LEEWAY - 1
    assert_invalid(verifier, sign_raw(header(), claims(**{name: NOW}), signing_key))
    clock.now = NOW - LEEWAY
    assert verifier.verify(sign_raw(header(), claims(**{name: NOW}), signing_key))


@pytest.mark.parametrize(
    "overrides",
    [
        {"exp": NOW + MAX_LIFETIME + 1},
        {"exp": NOW},
        {"exp": NOW - 1, "nbf": NOW - 100},
        {"nbf": NOW + 600},
    ],
    ids=["over-cap", "exp-equals-iat", "exp-before-iat", "nbf-at-exp"],
)
def test_lifetime_outside_the_cap_is_refused(
    verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey, clock: FakeClock, overrides: dict[str, Any]
) -> None:
    clock.now = NOW
    assert_invalid(verifier, sign_raw(header(), claims(**overrides), signing_key))


def test_lifetime_exactly_at_the_cap_is_accepted(
    verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey
) -> None:
    assert verifier.verify(sign_raw(header(), claims(exp=NOW + MAX_LIFETIME), signing_key))


@pytest.mark.parametrize("leeway", [61, 3600, -1])
def test_verifier_refuses_leeway_outside_zero_to_sixty_seconds(bundle: TrustBundle, leeway: int) -> None:
    with pytest.raises(ValueError, match="leeway"):
        CapabilityVerifier(
            bundle, issuers=[ISSUER], audience=AUDIENCE, max_lifetime_seconds=60, leeway_seconds=leeway
        )


# --- logging, helpers, minting ----------------------------------------------------------------


def test_rejections_log_neither_the_token_nor_the_user(
    verifier: CapabilityVerifier, signing_key: Ed25519PrivateKey, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    tokens = [
        sign_raw(header(alg="HS256"), claims(user="carol-secret-id"), signing_key),
        sign_raw(header(), claims(user="carol-secret-id", aud="x"), signing_key),
        sign_raw(header(), claims(user="carol-secret-id", ns="Bad"), signing_key),
    ]
    for token in tokens:
        with pytest.raises(CapabilityInvalid) as caught:
            verifier.verify(token)
        assert caught.value.__cause__ is None
    logged = "\n".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    assert caplog.records
    for token in tokens:
        for part in token.split("."):
            assert part not in logged
    assert "carol-secret-id" not in logged


def test_certificate_thumbprint_is_rfc8705_base64url_sha256() -> None:
    der = b"\x30\x82\x01\x0a" + bytes(300)
    digest = hashlib.sha256(der).digest()
    expected = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
    assert certificate_thumbprint(der) == expected
    assert certificate_thumbprint(digest) == expected
    assert len(expected) == 43


@pytest.mark.parametrize(
    "overrides",
    [
        {"namespace": "Bad"},
        {"agent": ""},
        {"per_user": True},
        {"knowledge_bases": ["a", "a"]},
        {"ttl_seconds": 0},
        {"cnf_x5t_s256": "short"},
        {"registry": "a_b"},
    ],
    ids=repr,
)
def test_mint_refuses_values_the_verifier_would_refuse(
    signing_key: Ed25519PrivateKey, overrides: dict[str, Any]
) -> None:
    arguments: dict[str, Any] = {"issuer": ISSUER, "audience": AUDIENCE, "namespace": "ns", "agent": "a"}
    with pytest.raises(InvalidArgument):
        mint_capability(signing_key, KID, **(arguments | overrides))


# --- property-based: nothing but CapabilityInvalid escapes ------------------------------------

_FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_CLAIM_NAMES = [
    "iss",
    "aud",
    "sub",
    "jti",
    "iat",
    "nbf",
    "exp",
    "ns",
    "agent",
    "user",
    "per_user",
    "registry",
    "ltm",
    "kbs",
    "cnf",
]


@_FUZZ
@given(data=st.binary(max_size=300))
def test_random_bytes_only_ever_raise_capability_invalid(verifier: CapabilityVerifier, data: bytes) -> None:
    with pytest.raises(CapabilityInvalid):
        verifier.verify(data.decode("latin-1"))


@_FUZZ
@given(text=st.text(max_size=300))
def test_random_text_only_ever_raises_capability_invalid(verifier: CapabilityVerifier, text: str) -> None:
    with pytest.raises(CapabilityInvalid):
        verifier.verify(text)


@_FUZZ
@given(parts=st.lists(st.binary(max_size=64), min_size=1, max_size=5))
def test_random_base64url_segments_only_ever_raise_capability_invalid(
    verifier: CapabilityVerifier, parts: list[bytes]
) -> None:
    with pytest.raises(CapabilityInvalid):
        verifier.verify(".".join(b64(p) for p in parts))


@_FUZZ
@given(
    header_extra=st.dictionaries(
        st.sampled_from(["alg", "typ", "kid", "crit", "jwk", "b64", "zip"]), _json, max_size=3
    ),
    mutations=st.dictionaries(st.sampled_from(_CLAIM_NAMES), _json, max_size=4),
)
def test_signed_tokens_with_random_claims_never_raise_other_errors(
    verifier: CapabilityVerifier,
    signing_key: Ed25519PrivateKey,
    header_extra: dict[str, Any],
    mutations: dict[str, Any],
) -> None:
    token = sign_raw(header(**header_extra), claims(**mutations), signing_key)
    try:
        verified = verifier.verify(token)
    except (CapabilityInvalid, CapabilityExpired):
        return
    assert isinstance(verified, VerifiedCapability)
    assert type(verified.expires_at) is int
