"""Minting capabilities for the control plane (IssueCapability), with the request validated.

Only a server configured with a signing key can mint; the format is exactly what the verifier
accepts (see docs/capabilities.md), so a capability minted here and one minted by the control
plane with any JWT library are indistinguishable.
"""

from __future__ import annotations

import base64
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tokensvc.auth.capabilities import mint_capability
from tokensvc.auth.keys import load_signing_key
from tokensvc.errors import InvalidArgument, Reason, TokensvcError
from tokensvc.names import is_dns_label, is_kb_ref

__all__ = ["CapabilityIssuer", "IssueRequest", "IssuedCapability"]

_RUN_ID = re.compile(r"[A-Za-z0-9._:-]{1,256}")
_DEFAULT_TTL = 3600


@dataclass(frozen=True)
class IssueRequest:
    namespace: str
    agent: str
    user: str | None = field(repr=False)
    per_user: bool
    registry: str | None
    long_term_memory: bool
    knowledge_bases: Sequence[str]
    run_id: str | None
    ttl_seconds: int | None
    cnf_x5t_s256: bytes | None


@dataclass(frozen=True)
class IssuedCapability:
    token: str = field(repr=False)
    jti: str
    run_id: str
    expires_at: int


class CapabilityIssuer:
    def __init__(
        self, signing_key: Ed25519PrivateKey, kid: str, *, issuer: str, audience: str, max_lifetime: int
    ):
        self._key = signing_key
        self._kid = kid
        self._issuer = issuer
        self._audience = audience
        self._max_lifetime = max_lifetime

    @classmethod
    def from_file(cls, path: Path, *, issuer: str, audience: str, max_lifetime: int) -> CapabilityIssuer:
        kid, key = load_signing_key(path)
        return cls(key, kid, issuer=issuer, audience=audience, max_lifetime=max_lifetime)

    def issue(self, request: IssueRequest, now: float) -> IssuedCapability:
        _check_request(request, self._max_lifetime)
        jti = uuid.uuid4().hex
        run_id = request.run_id or str(uuid.uuid4())
        ttl = request.ttl_seconds or min(_DEFAULT_TTL, self._max_lifetime)
        thumbprint = (
            base64.urlsafe_b64encode(request.cnf_x5t_s256).rstrip(b"=").decode()
            if request.cnf_x5t_s256
            else None
        )
        token = mint_capability(
            self._key,
            self._kid,
            issuer=self._issuer,
            audience=self._audience,
            namespace=request.namespace,
            agent=request.agent,
            run_id=run_id,
            user=request.user,
            per_user=request.per_user,
            registry=request.registry,
            long_term_memory=request.long_term_memory,
            knowledge_bases=list(request.knowledge_bases),
            ttl_seconds=ttl,
            cnf_x5t_s256=thumbprint,
            now=now,
            jti=jti,
        )
        return IssuedCapability(token=token, jti=jti, run_id=run_id, expires_at=int(now) + ttl)


def _check_request(request: IssueRequest, max_lifetime: int) -> None:
    for name in ("namespace", "agent"):
        if not is_dns_label(getattr(request, name)):
            raise InvalidArgument(name, "must be a Kubernetes name (lower-case DNS label)")
    if request.registry is not None and not is_dns_label(request.registry):
        raise InvalidArgument("registry", "must be a Kubernetes name (lower-case DNS label)")
    if request.user is not None and not 0 < len(request.user) <= 512:
        raise InvalidArgument("user", "must be 1..512 characters")
    if request.per_user and request.user is None:
        raise InvalidArgument("user", "required when per_user is true")
    if len(request.knowledge_bases) > 64:
        raise InvalidArgument("knowledge_bases", "at most 64 knowledge bases")
    for index, ref in enumerate(request.knowledge_bases):
        if not is_kb_ref(ref):
            raise InvalidArgument(f"knowledge_bases[{index}]", "is not a valid knowledge base ref")
    if len(set(request.knowledge_bases)) != len(request.knowledge_bases):
        raise InvalidArgument("knowledge_bases", "must not repeat a ref")
    if request.run_id is not None and not _RUN_ID.fullmatch(request.run_id):
        raise InvalidArgument("run_id", "must be 1..256 characters of [A-Za-z0-9._:-]")
    if request.ttl_seconds is not None and not 60 <= request.ttl_seconds <= max_lifetime:
        raise InvalidArgument("ttl", f"must be between 60 and {max_lifetime} seconds")
    if request.cnf_x5t_s256 is not None and len(request.cnf_x5t_s256) != 32:
        raise InvalidArgument("cnf_x5t_s256", "must be the 32-byte SHA-256 of the certificate")


def signing_key_missing() -> TokensvcError:
    return TokensvcError(
        "this tokensvc has no signing key configured; capabilities are minted by the control plane",
        reason=Reason.SIGNING_KEY_NOT_CONFIGURED,
    )
