"""CapabilityService over real mTLS: every capability rule attacked on the wire and refused.

Attack tokens are signed with the *trusted* dev key wherever the rule allows, so the one rule
under test is the only thing that can refuse them.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import jwt
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from google.protobuf import duration_pb2

from tests.support import (
    AUDIENCE,
    ISSUER,
    RpcFailure,
    Signer,
    b64url,
    bearer,
    failure_of,
    launcher_claims,
    mtls_channel,
    role_channel,
    segment,
)
from tokensvc.app import Service
from tokensvc.auth.capabilities import CAPABILITY_TYPE
from tokensvc.auth.devpki import DevPaths, issue_client_certificate, public_jwk
from tokensvc.errors import CapabilityInvalid
from tokensvc.v1 import capability_pb2, capability_pb2_grpc

Stub = capability_pb2_grpc.CapabilityServiceStub
Metadata = tuple[tuple[str, str], ...]

TYP = CAPABILITY_TYPE
MAX_LIFETIME = 12 * 3600
OTHER_AGENT_ID = "spiffe://dev.local/ns/default/sa/other-agent"
# Every bad-token refusal carries this one message: it must not say which check failed.
REFUSAL_MESSAGE = CapabilityInvalid().message
BUCKET = re.compile(r"v1\.[a-z2-7]{52}")
MISSING, INVALID, EXPIRED = "CAPABILITY_MISSING", "CAPABILITY_INVALID", "CAPABILITY_EXPIRED"
SESSION, SHARED = capability_pb2.SESSION_SCOPE_SESSION, capability_pb2.SESSION_SCOPE_SHARED


# --- tokens -----------------------------------------------------------------------------------


def now() -> int:
    return int(time.time())


def thumbprint(cert_pem: bytes) -> str:
    """RFC 8705 x5t#S256 of a PEM certificate: base64url (no padding) of its DER's SHA-256."""
    return b64url(certificate_sha256(cert_pem))


def certificate_sha256(cert_pem: bytes) -> bytes:
    der = x509.load_pem_x509_certificate(cert_pem).public_bytes(serialization.Encoding.DER)
    return hashlib.sha256(der).digest()


# --- calls ------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def stub_for(port: int, dev: DevPaths, role: str) -> AsyncIterator[Stub]:
    async with role_channel(port, dev, role) as channel:
        yield Stub(channel)


async def verify(stub: Stub, token: str) -> capability_pb2.VerifyCapabilityResponse:
    request = capability_pb2.VerifyCapabilityRequest()
    return await stub.VerifyCapability(request, metadata=bearer(token), timeout=10)


async def session_key(
    stub: Stub, token: str, conversation_id: str, scope: int = SESSION
) -> capability_pb2.DeriveSessionKeyResponse:
    request = capability_pb2.DeriveSessionKeyRequest(conversation_id=conversation_id, scope=scope)
    return await stub.DeriveSessionKey(request, metadata=bearer(token), timeout=10)


async def revoke(stub: Stub, **target: str) -> capability_pb2.RevokeCapabilityResponse:
    request = capability_pb2.RevokeCapabilityRequest(reason="test", **target)
    return await stub.RevokeCapability(request, timeout=10)


async def refusal(call: Awaitable[Any]) -> RpcFailure:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return failure_of(caught.value)


def assert_bad_token(failure: RpcFailure, reason: str) -> None:
    assert (failure.code, failure.reason) == (grpc.StatusCode.UNAUTHENTICATED, reason)
    assert failure.message == REFUSAL_MESSAGE


def assert_denied(failure: RpcFailure, reason: str) -> None:
    assert (failure.code, failure.reason) == (grpc.StatusCode.PERMISSION_DENIED, reason)


def assert_invalid_argument(failure: RpcFailure, field: str) -> None:
    assert (failure.code, failure.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT")
    assert failure.metadata["field"] == field


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture
def signer(dev: DevPaths) -> Signer:
    return Signer.dev(dev)


@pytest.fixture
async def launcher(service: Service, dev: DevPaths) -> AsyncIterator[Stub]:
    async with stub_for(service.port, dev, "launcher") as stub:
        yield stub


@pytest.fixture
async def control_plane(service: Service, dev: DevPaths) -> AsyncIterator[Stub]:
    async with stub_for(service.port, dev, "control-plane") as stub:
        yield stub


@pytest.fixture
async def admin(service: Service, dev: DevPaths) -> AsyncIterator[Stub]:
    async with stub_for(service.port, dev, "admin") as stub:
        yield stub


@pytest.fixture
async def other_agent(service: Service, dev: DevPaths, tmp_path: Path) -> AsyncIterator[Stub]:
    """A launcher of the same CA and namespace, but another agent."""
    cert, key = issue_client_certificate(dev, OTHER_AGENT_ID, tmp_path / "other-agent")
    async with mtls_channel(service.port, dev.ca_cert, cert, key) as channel:
        yield Stub(channel)


# --- VerifyCapability -------------------------------------------------------------------------


async def test_verify_returns_the_scope_and_never_the_raw_user_id(launcher: Stub, signer: Signer) -> None:
    user, run_id, jti, iat = (
        f"alice-{uuid.uuid4()}@example.com",
        f"run-{uuid.uuid4()}",
        uuid.uuid4().hex,
        now(),
    )
    token = signer.token(
        sub=run_id,
        jti=jti,
        iat=iat,
        nbf=iat,
        exp=iat + 900,
        user=user,
        per_user=True,
        registry="support",
        ltm=True,
        kbs=["handbook", "faq.v2"],
    )
    response = await verify(launcher, token)
    scope = response.scope
    assert (scope.namespace, scope.agent, scope.registry) == ("default", "dev-agent", "support")
    assert BUCKET.fullmatch(scope.bucket_id)
    assert (scope.per_user, scope.long_term_memory) == (True, True)
    assert list(scope.knowledge_bases) == ["handbook", "faq.v2"]
    assert (scope.run_id, scope.jti) == (run_id, jti)
    assert (scope.issued_at.seconds, scope.expires_at.seconds) == (iat, iat + 900)
    serialized = response.SerializeToString()
    for spelling in (user, user.partition("@")[0], user.upper(), b64url(user.encode())):
        assert spelling.encode() not in serialized


async def test_per_user_buckets_differ_per_user_and_agent_wide_bucket_is_shared(
    launcher: Stub, signer: Signer
) -> None:
    users = [f"alice-{uuid.uuid4()}", f"bob-{uuid.uuid4()}"]
    per_user = [(await verify(launcher, signer.token(user=u, per_user=True))).scope.bucket_id for u in users]
    agent_wide = [(await verify(launcher, signer.token(user=u))).scope.bucket_id for u in users]
    assert per_user[0] != per_user[1]
    assert agent_wide[0] == agent_wide[1]
    assert agent_wide[0] not in per_user


async def test_token_minted_with_plain_pyjwt_is_accepted(launcher: Stub, signer: Signer) -> None:
    payload = launcher_claims(user="someone", per_user=True, ltm=True, kbs=["handbook"])
    token = jwt.encode(payload, signer.key, algorithm="EdDSA", headers={"typ": TYP, "kid": signer.kid})
    scope = (await verify(launcher, token)).scope
    assert (scope.run_id, scope.jti, scope.per_user) == (payload["sub"], payload["jti"], True)


def with_times(iat: int = 0, nbf: int = 0, exp: int = 600) -> Callable[[Signer], str]:
    """Time claims relative to when the test runs (not when it was collected)."""

    def make(s: Signer) -> str:
        start = now()
        return s.token(iat=start + iat, nbf=start + nbf, exp=start + exp)

    return make


def with_claims(**overrides: Any) -> Callable[[Signer], str]:
    return lambda s: s.token(**overrides)


def with_header(**extra: Any) -> Callable[[Signer], str]:
    """Signed by the trusted key: only the header rule can refuse it."""
    return lambda s: s.sign(s.header(**extra), launcher_claims())


def with_payload(payload: Any) -> Callable[[Signer], str]:
    return lambda s: s.sign(s.header(), payload)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(with_times(iat=-60, nbf=-60, exp=-10), id="exp-within-the-30s-leeway"),
        pytest.param(with_times(nbf=10), id="nbf-within-the-30s-leeway"),
        pytest.param(with_times(exp=MAX_LIFETIME), id="lifetime-exactly-at-the-cap"),
        pytest.param(with_claims(aud=[AUDIENCE]), id="aud-as-a-one-element-list"),
    ],
)
async def test_edge_of_the_rules_is_accepted(
    launcher: Stub, signer: Signer, make: Callable[[Signer], str]
) -> None:
    await verify(launcher, make(signer))


# --- bad tokens -------------------------------------------------------------------------------


def hs256_signed_with_the_public_key(s: Signer) -> str:
    public_pem = s.key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    signing_input = f"{segment(s.header(alg='HS256'))}.{segment(launcher_claims())}"
    return f"{signing_input}.{b64url(hmac.new(public_pem, signing_input.encode(), hashlib.sha256).digest())}"


def rs256(s: Signer) -> str:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return jwt.encode(launcher_claims(), key, algorithm="RS256", headers={"typ": TYP, "kid": s.kid})


def impossible_base64_length(s: Signer) -> str:
    payload = segment(launcher_claims())
    while len(payload) % 4 != 1:
        payload += "A"
    return s.sign_segments(segment(s.header()), payload)


ATTACKER_JWK = public_jwk(Ed25519PrivateKey.generate().public_key(), "attacker")
FOREIGN_KEY = Ed25519PrivateKey.generate()
ATTACKER_X5C = [base64.b64encode(b"DER of the attacker's certificate").decode()]

NO_TOKEN: list[tuple[str, Callable[[Signer], Metadata]]] = [
    ("no-authorization", lambda s: ()),
    ("basic-scheme", lambda s: (("authorization", f"Basic {s.token()}"),)),
    ("bearer-without-token", lambda s: (("authorization", "Bearer "),)),
    ("two-authorization-headers", lambda s: bearer(s.token()) + bearer(s.token())),
]
BAD_TOKENS: list[tuple[str, Callable[[Signer], str], str]] = [
    (
        "alg-none-unsigned",
        lambda s: f"{segment(s.header(alg='none'))}.{segment(launcher_claims())}.",
        INVALID,
    ),
    ("alg-none-signed", with_header(alg="none"), INVALID),
    ("alg-None", with_header(alg="None"), INVALID),
    ("hs256-signed-with-the-public-key", hs256_signed_with_the_public_key, INVALID),
    ("rs256", rs256, INVALID),
    ("typ-not-run-cap", with_header(typ="JWT"), INVALID),
    ("kid-missing", lambda s: s.sign({"alg": "EdDSA", "typ": TYP}, launcher_claims()), INVALID),
    ("embedded-jwk", with_header(jwk=ATTACKER_JWK), INVALID),
    ("jku", with_header(jku="https://attacker.example/jwks"), INVALID),
    ("x5u", with_header(x5u="https://attacker.example/cert.pem"), INVALID),
    ("x5c", with_header(x5c=ATTACKER_X5C), INVALID),
    ("x5t", with_header(x5t=b64url(b"sha-1 thumbprint of a certificate")), INVALID),
    ("x5t#S256", with_header(**{"x5t#S256": b64url(hashlib.sha256(b"certificate").digest())}), INVALID),
    ("b64-false", with_header(b64=False, crit=["b64"]), INVALID),
    ("unknown-crit", with_header(crit=["urn:x"], **{"urn:x": 1}), INVALID),
    ("two-segments", lambda s: s.token().rsplit(".", 1)[0], INVALID),
    ("four-segments", lambda s: f"{s.token()}.{b64url(b'extra')}", INVALID),
    (
        "padded-base64",
        lambda s: s.sign_segments(segment(s.header()) + "=", segment(launcher_claims())),
        INVALID,
    ),
    ("impossible-base64-length", impossible_base64_length, INVALID),
    ("payload-not-json", with_payload(b"not json at all"), INVALID),
    ("payload-json-array", with_payload([{"iss": ISSUER}]), INVALID),
    ("payload-json-string", with_payload("a string"), INVALID),
    ("payload-deeply-nested", with_payload(b"[" * 2000 + b"]" * 2000), INVALID),
    ("exp-as-string", lambda s: s.token(exp=str(now() + 600)), INVALID),
    ("exp-negative", with_claims(exp=-1), INVALID),
    ("exp-huge", with_claims(exp=10**20), INVALID),
    ("exp-float", lambda s: s.token(exp=now() + 600.5), INVALID),
    ("expired-beyond-leeway", with_times(iat=-900, nbf=-900, exp=-31), EXPIRED),
    ("nbf-in-the-future", with_times(nbf=120, exp=900), INVALID),
    ("iat-in-the-future", with_times(iat=120, nbf=120, exp=900), INVALID),
    ("lifetime-over-the-cap", with_times(exp=MAX_LIFETIME + 1), INVALID),
    ("wrong-iss", with_claims(iss="someone-else"), INVALID),
    ("wrong-aud", with_claims(aud="another-service"), INVALID),
    ("aud-with-a-second-audience", with_claims(aud=[AUDIENCE, "another-service"]), INVALID),
    ("unknown-kid", lambda s: Signer("no-such-kid", s.key).token(), INVALID),
    # A genuine signature by a key that is not in the bundle, claiming the trusted kid.
    ("signed-by-a-key-not-in-the-bundle", lambda s: Signer(s.kid, FOREIGN_KEY).token(), INVALID),
    ("per-user-without-user", with_claims(per_user=True), INVALID),
    ("ns-not-a-dns-label", with_claims(ns="Default"), INVALID),
]


@pytest.mark.parametrize("make", [m for _, m in NO_TOKEN], ids=[i for i, _ in NO_TOKEN])
async def test_call_without_exactly_one_bearer_token_is_capability_missing(
    launcher: Stub, signer: Signer, make: Callable[[Signer], Metadata]
) -> None:
    request = capability_pb2.VerifyCapabilityRequest()
    assert_bad_token(
        await refusal(launcher.VerifyCapability(request, metadata=make(signer), timeout=10)), MISSING
    )


@pytest.mark.parametrize(("make", "reason"), [c[1:] for c in BAD_TOKENS], ids=[c[0] for c in BAD_TOKENS])
async def test_bad_token_is_unauthenticated_with_one_message(
    launcher: Stub, signer: Signer, make: Callable[[Signer], str], reason: str
) -> None:
    token = make(signer)
    failure = await refusal(verify(launcher, token))
    assert_bad_token(failure, reason)
    assert token not in f"{failure.message} {failure.metadata}"


def padded_token(s: Signer, size: int) -> str:
    """A valid capability (but for its size) of about `size` characters."""
    token = s.token(pad="x" * ((size - len(s.token(pad=""))) * 3 // 4))
    assert size - 8 < len(token) <= size
    return token


@pytest.mark.parametrize("size", [8300, 20_000], ids=["just-over-8-kib", "20-kib"])
async def test_token_over_8_kib_is_refused_as_invalid(launcher: Stub, signer: Signer, size: int) -> None:
    assert_bad_token(await refusal(verify(launcher, padded_token(signer, size))), INVALID)


async def test_valid_token_just_under_8_kib_is_accepted_every_time(launcher: Stub, signer: Signer) -> None:
    # All request headers together then exceed gRPC's default 8 KiB metadata budget, which would
    # shed some calls with RESOURCE_EXHAUSTED; the server raises that budget.
    token = padded_token(signer, 8190)
    for _ in range(50):
        await verify(launcher, token)


# --- binding and roles ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "presenter"),
    [
        pytest.param(lambda dev: {}, "other_agent", id="another-agents-certificate"),
        pytest.param(lambda dev: {"ns": "other"}, "launcher", id="another-namespace"),
        pytest.param(
            lambda dev: {"cnf": {"x5t#S256": thumbprint(dev.client("admin")[0].read_bytes())}},
            "launcher",
            id="cnf-of-another-certificate",
        ),
        pytest.param(
            lambda dev: {"cnf": {"x5t#S256": thumbprint(dev.client("launcher")[0].read_bytes())}},
            "other_agent",
            id="cnf-of-the-launcher-presented-by-another-agent",
        ),
    ],
)
async def test_capability_bound_elsewhere_is_binding_mismatch(
    launcher: Stub,
    other_agent: Stub,
    dev: DevPaths,
    signer: Signer,
    overrides: Callable[[DevPaths], dict[str, Any]],
    presenter: str,
) -> None:
    stub = {"launcher": launcher, "other_agent": other_agent}[presenter]
    assert_denied(await refusal(verify(stub, signer.token(**overrides(dev)))), "BINDING_MISMATCH")


async def test_cnf_thumbprint_of_the_presented_certificate_is_accepted(
    launcher: Stub, signer: Signer, dev: DevPaths
) -> None:
    token = signer.token(cnf={"x5t#S256": thumbprint(dev.client("launcher")[0].read_bytes())})
    assert (await verify(launcher, token)).scope.agent == "dev-agent"


LAUNCHER_RPCS = ("VerifyCapability", "DeriveSessionKey")


@pytest.mark.parametrize(
    ("role", "method"),
    [
        *((role, method) for role in ("admin", "control-plane") for method in LAUNCHER_RPCS),
        ("launcher", "IssueCapability"),
        ("launcher", "RevokeCapability"),
    ],
)
async def test_rpc_refuses_roles_it_does_not_list(
    service: Service, dev: DevPaths, signer: Signer, role: str, method: str
) -> None:
    run_id = f"run-{uuid.uuid4()}"
    token = signer.token(sub=run_id)
    request = {
        "VerifyCapability": capability_pb2.VerifyCapabilityRequest(),
        "DeriveSessionKey": capability_pb2.DeriveSessionKeyRequest(conversation_id="c1"),
        "IssueCapability": capability_pb2.IssueCapabilityRequest(namespace="default", agent="dev-agent"),
        "RevokeCapability": capability_pb2.RevokeCapabilityRequest(run_id=run_id),
    }[method]
    async with stub_for(service.port, dev, role) as stub:
        failure = await refusal(getattr(stub, method)(request, metadata=bearer(token), timeout=10))
    assert_denied(failure, "ROLE_NOT_ALLOWED")
    async with stub_for(service.port, dev, "launcher") as launcher:
        await verify(launcher, token)  # nothing was revoked


# --- DeriveSessionKey -------------------------------------------------------------------------

PRIVATE, PER_USER = "mem:default/dev-agent:{cid}", "mem:default/dev-agent:{bucket}:{cid}"
REGISTRY = "mem:shared:support:{cid}"
ALICE = {"user": "user-alice", "per_user": True}


@pytest.mark.parametrize(
    ("overrides", "scope", "layout", "effective", "downgraded"),
    [
        pytest.param({"registry": "support"}, SESSION, PRIVATE, SESSION, False, id="session"),
        pytest.param({}, capability_pb2.SESSION_SCOPE_UNSPECIFIED, PRIVATE, SESSION, False, id="unspecified"),
        pytest.param({"registry": "support", **ALICE}, SHARED, REGISTRY, SHARED, False, id="shared"),
        pytest.param({"user": "user-alice"}, SHARED, PRIVATE, SESSION, True, id="shared-without-registry"),
        pytest.param(ALICE, SESSION, PER_USER, SESSION, False, id="per-user"),
        pytest.param(ALICE, SHARED, PER_USER, SESSION, True, id="per-user-shared-without-registry"),
    ],
)
async def test_session_key_matches_the_documented_layout_exactly(
    launcher: Stub,
    signer: Signer,
    overrides: dict[str, Any],
    scope: int,
    layout: str,
    effective: int,
    downgraded: bool,
) -> None:
    cid, token = str(uuid.uuid4()), signer.token(**overrides)
    bucket = (await verify(launcher, token)).scope.bucket_id  # the bucket VerifyCapability reports
    response = await session_key(launcher, token, cid, scope)
    assert response.key == layout.format(cid=cid, bucket=bucket)
    assert (response.effective_scope, response.downgraded) == (effective, downgraded)
    assert response.per_user == (layout == PER_USER)
    assert b"user-alice" not in response.SerializeToString()


async def test_session_key_carries_the_documented_defaults_and_allows_128_characters(
    launcher: Stub, signer: Signer
) -> None:
    response = await session_key(launcher, signer.token(), "c" * 128)
    assert response.key == PRIVATE.format(cid="c" * 128)
    assert (response.max_history_messages, response.max_retained_entries) == (40, 500)
    assert (response.ttl.seconds, response.ttl.nanos) == (86400, 0)
    assert response.ttl_refreshed_on_write is True


@pytest.mark.parametrize(
    "conversation_id",
    ["", "x" * 129, "a/b", "a:b", "a b", "a\tb", "a\nb", "a\x00b", "a\x7fb"],
    ids=["empty", "129-chars", "slash", "colon", "space", "tab", "newline", "nul", "del"],
)
async def test_bad_conversation_id_is_invalid_argument_naming_the_field(
    launcher: Stub, signer: Signer, conversation_id: str
) -> None:
    failure = await refusal(session_key(launcher, signer.token(), conversation_id))
    assert_invalid_argument(failure, "conversation_id")
    assert failure.field_violations == ["conversation_id"]


async def test_unknown_session_scope_is_invalid_argument(launcher: Stub, signer: Signer) -> None:
    assert_invalid_argument(await refusal(session_key(launcher, signer.token(), "c1", scope=7)), "scope")


# --- IssueCapability --------------------------------------------------------------------------


async def test_issued_capability_is_accepted_for_the_launcher_only(
    control_plane: Stub, launcher: Stub, other_agent: Stub, dev: DevPaths
) -> None:
    run_id = f"run-{uuid.uuid4()}"
    request = capability_pb2.IssueCapabilityRequest(
        namespace="default",
        agent="dev-agent",
        user="carol",
        per_user=True,
        registry="support",
        long_term_memory=True,
        knowledge_bases=["handbook"],
        run_id=run_id,
        ttl=duration_pb2.Duration(seconds=600),
        cnf_x5t_s256=certificate_sha256(dev.client("launcher")[0].read_bytes()),
    )
    issued = await control_plane.IssueCapability(request, timeout=10)
    assert issued.run_id == run_id
    scope = (await verify(launcher, issued.token)).scope
    assert (scope.jti, scope.run_id, scope.expires_at) == (issued.jti, issued.run_id, issued.expires_at)
    assert (scope.per_user, scope.registry, list(scope.knowledge_bases)) == (True, "support", ["handbook"])
    assert scope.expires_at.seconds - scope.issued_at.seconds == 600
    assert_denied(await refusal(verify(other_agent, issued.token)), "BINDING_MISMATCH")


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        pytest.param({"namespace": "Bad_NS"}, "namespace", id="namespace-not-a-dns-label"),
        pytest.param({"ttl": duration_pb2.Duration(seconds=MAX_LIFETIME + 1)}, "ttl", id="ttl-over-the-max"),
        pytest.param({"per_user": True}, "user", id="per-user-without-user"),
        pytest.param({"cnf_x5t_s256": b"\x01" * 31}, "cnf_x5t_s256", id="cnf-of-31-bytes"),
        # `$` in a pattern used with match() accepts a trailing newline; fullmatch does not.
        pytest.param({"run_id": "run-1\n"}, "run_id", id="run-id-with-a-trailing-newline"),
        pytest.param({"namespace": "default\n"}, "namespace", id="namespace-with-a-trailing-newline"),
        pytest.param({"registry": "support\n"}, "registry", id="registry-with-a-trailing-newline"),
        pytest.param(
            {"knowledge_bases": ["kb\n"]}, "knowledge_bases[0]", id="kb-ref-with-a-trailing-newline"
        ),
    ],
)
async def test_issue_with_bad_input_is_invalid_argument_naming_the_field(
    control_plane: Stub, fields: dict[str, Any], field: str
) -> None:
    request = capability_pb2.IssueCapabilityRequest(
        **{"namespace": "default", "agent": "dev-agent", **fields}
    )
    assert_invalid_argument(await refusal(control_plane.IssueCapability(request, timeout=10)), field)


async def test_issue_without_a_signing_key_is_failed_precondition(start_service: Any, dev: DevPaths) -> None:
    # An empty value unsets an optional setting (load_settings ignores None overrides).
    service = await start_service(signing_key_file="")
    assert service.settings.signing_key_file is None
    request = capability_pb2.IssueCapabilityRequest(namespace="default", agent="dev-agent")
    async with stub_for(service.port, dev, "control-plane") as stub:
        failure = await refusal(stub.IssueCapability(request, timeout=10))
    assert (failure.code, failure.reason) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "SIGNING_KEY_NOT_CONFIGURED",
    )


# --- revocation and the verification cache ----------------------------------------------------


async def test_revoked_jti_is_refused_and_evicted_from_the_cache(
    service: Service, launcher: Stub, control_plane: Stub, signer: Signer
) -> None:
    assert service.authenticator is not None
    token = signer.token()
    jti = (await verify(launcher, token)).scope.jti
    assert len(service.authenticator.cache) == 1
    await revoke(control_plane, jti=jti)
    assert len(service.authenticator.cache) == 0
    assert_bad_token(await refusal(verify(launcher, token)), "CAPABILITY_REVOKED")
    await verify(launcher, signer.token())  # other capabilities are untouched


async def test_revoked_run_refuses_every_token_of_the_run_even_ones_minted_later(
    launcher: Stub, admin: Stub, signer: Signer
) -> None:
    run_id = f"run-{uuid.uuid4()}"
    before = [signer.token(sub=run_id) for _ in range(2)]
    for token in before:
        await verify(launcher, token)
    await revoke(admin, run_id=run_id)
    for token in [*before, signer.token(sub=run_id)]:
        assert_bad_token(await refusal(verify(launcher, token)), "CAPABILITY_REVOKED")
    await verify(launcher, signer.token())


async def test_revoke_without_a_target_is_invalid_argument(control_plane: Stub) -> None:
    request = capability_pb2.RevokeCapabilityRequest(reason="no target")
    assert_invalid_argument(await refusal(control_plane.RevokeCapability(request, timeout=10)), "target")


async def test_revoking_twice_is_idempotent(control_plane: Stub, admin: Stub) -> None:
    jti = uuid.uuid4().hex
    first = await revoke(control_plane, jti=jti)
    await asyncio.sleep(0.01)
    second = await revoke(admin, jti=jti)
    assert first.revoked_at == second.revoked_at
    assert first.revoked_at.seconds > 0


async def test_second_verify_is_a_cache_hit_and_binding_is_checked_on_hits(
    service: Service, launcher: Stub, other_agent: Stub, signer: Signer
) -> None:
    assert service.authenticator is not None
    cache, token = service.authenticator.cache, signer.token()
    await verify(launcher, token)
    hits = cache.hits
    await verify(launcher, token)
    assert cache.hits == hits + 1
    assert_denied(await refusal(verify(other_agent, token)), "BINDING_MISMATCH")
    assert cache.hits == hits + 2


# --- trust bundle -----------------------------------------------------------------------------


def write_bundle(path: Path, keys: list[dict[str, Any]]) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_text(json.dumps({"keys": keys}))
    os.replace(tmp, path)


async def test_trust_bundle_file_changes_apply_after_the_check_interval(
    start_service: Any, dev: DevPaths, signer: Signer, tmp_path: Path
) -> None:
    dev_keys = json.loads(dev.trust_bundle.read_text())["keys"]
    bundle = tmp_path / "trust-bundle.jwks"
    write_bundle(bundle, dev_keys)
    service = await start_service(trust_bundle_file=str(bundle))
    assert service.authenticator is not None
    second = Signer(f"second-{uuid.uuid4().hex[:8]}", Ed25519PrivateKey.generate())
    second_jwk = public_jwk(second.key.public_key(), second.kid)
    async with stub_for(service.port, dev, "launcher") as stub:
        new_token, old_token = second.token(), signer.token()
        assert_bad_token(await refusal(verify(stub, new_token)), INVALID)
        await verify(stub, old_token)

        write_bundle(bundle, [*dev_keys, second_jwk])
        await asyncio.sleep(1.2)  # the bundle's check interval is 1 s
        await verify(stub, new_token)
        await verify(stub, old_token)  # now cached under this bundle generation

        tmp = bundle.with_name("half-written.tmp")
        tmp.write_text('{"keys": [')
        os.replace(tmp, bundle)
        await asyncio.sleep(1.2)  # a broken file is refused as a whole: the keys in force stay
        await verify(stub, new_token)
        hits = service.authenticator.cache.hits
        await verify(stub, old_token)
        assert service.authenticator.cache.hits == hits + 1  # the dev key's token is cached

        write_bundle(bundle, [second_jwk])
        await asyncio.sleep(1.2)
        assert_bad_token(await refusal(verify(stub, old_token)), INVALID)
        await verify(stub, new_token)


async def test_shared_keys_carry_the_namespace_only_when_the_setting_says_so(
    start_service: Any, dev: DevPaths, signer: Signer
) -> None:
    token = signer.token(registry="support")
    keys = {}
    for qualified in (False, True):
        service = await start_service(shared_session_keys_per_namespace=qualified)
        async with stub_for(service.port, dev, "launcher") as stub:
            keys[qualified] = (await session_key(stub, token, "conv-7", SHARED)).key
    assert keys == {False: "mem:shared:support:conv-7", True: "mem:shared:default/support:conv-7"}
