"""From a bearer token and a verified caller to a tenant scope, or a refusal.

Order: cached verification (keyed by the token's SHA-256, valid until `exp` and only for the trust
bundle generation it was verified under), revocation, then binding to the caller: the launcher's
SPIFFE ID must name the capability's namespace and agent, and a `cnf.x5t#S256` must equal the
SHA-256 of the peer's leaf certificate (RFC 8705). Binding is checked on every call, cached or
not, so a stolen token is useless from another certificate.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from tokensvc.auth.buckets import PepperKeyring
from tokensvc.auth.capabilities import CapabilityVerifier, VerifiedCapability
from tokensvc.auth.identity import Caller
from tokensvc.auth.keyset import TrustBundle
from tokensvc.auth.revocation import RevocationList
from tokensvc.auth.scope import TenantScope, scope_of
from tokensvc.errors import (
    CapabilityExpired,
    CapabilityRevoked,
    DatabaseUnavailable,
    PermissionDenied,
    Reason,
    TokensvcError,
)
from tokensvc.observability.metrics import METRICS
from tokensvc.storage.records import RevocationKind

__all__ = ["Authenticator", "VerificationCache"]


@dataclass(frozen=True)
class _Entry:
    capability: VerifiedCapability
    scope: TenantScope
    generation: int


class VerificationCache:
    """Verified capabilities by token hash: bounded, LRU, evicted on expiry and revocation."""

    def __init__(self, capacity: int):
        self._capacity = capacity
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: bytes, now: float, generation: int) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is None or entry.generation != generation or entry.capability.expires_at <= now:
            if entry is not None:
                del self._entries[key]
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    def put(self, key: bytes, entry: _Entry) -> None:
        if self._capacity == 0:
            return
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)

    def evict(self, kind: RevocationKind, value: str) -> None:
        doomed = [
            key
            for key, entry in self._entries.items()
            if (entry.capability.jti if kind == "jti" else entry.capability.run_id) == value
        ]
        for key in doomed:
            del self._entries[key]

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


class Authenticator:
    """The edge's CapabilityAuthenticator: token + caller -> TenantScope."""

    def __init__(
        self,
        *,
        verifier: CapabilityVerifier,
        bundle: TrustBundle,
        keyring: PepperKeyring,
        revocations: RevocationList,
        launcher_id: Callable[[str, str], str],
        cache_size: int = 10_000,
        clock: Callable[[], float] = time.time,
    ):
        self._verifier = verifier
        self._bundle = bundle
        self._keyring = keyring
        self._revocations = revocations
        self._launcher_id = launcher_id
        self._clock = clock
        self.cache = VerificationCache(cache_size)
        revocations.on_revoked(self.cache.evict)

    async def authenticate(self, token: str, caller: Caller) -> TenantScope:
        try:
            capability, scope = self._verified(token)
            if self._revocations.is_revoked(capability.jti, capability.run_id):
                raise CapabilityRevoked()
            if not self._revocations.is_current:
                # Fail closed: a replica cut off from the revocation table cannot vouch for a token.
                raise DatabaseUnavailable("revocations cannot be checked right now; retry later")
            self._check_binding(capability, caller)
        except TokensvcError as exc:
            METRICS.verifications.labels(exc.reason.value.lower()).inc()
            raise
        METRICS.verifications.labels("accepted").inc()
        return scope

    def _verified(self, token: str) -> tuple[VerifiedCapability, TenantScope]:
        self._bundle.refresh_if_changed()
        key = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
        now = self._clock()
        entry = self.cache.get(key, now, self._bundle.generation)
        METRICS.verification_cache.labels("miss" if entry is None else "hit").inc()
        if entry is None:
            generation = self._bundle.generation
            capability = self._verifier.verify(token)
            entry = _Entry(capability, scope_of(capability, self._keyring), generation)
            self.cache.put(key, entry)
        elif entry.capability.expires_at <= now:
            raise CapabilityExpired()
        return entry.capability, entry.scope

    def _check_binding(self, capability: VerifiedCapability, caller: Caller) -> None:
        expected = self._launcher_id(capability.namespace, capability.agent)
        if not hmac.compare_digest(caller.spiffe_id.encode(), expected.encode()):
            raise PermissionDenied(Reason.BINDING_MISMATCH)
        if capability.cnf_x5t_s256 is not None:
            presented = base64.urlsafe_b64encode(caller.certificate_sha256).rstrip(b"=").decode()
            if not hmac.compare_digest(presented.encode(), capability.cnf_x5t_s256.encode()):
                raise PermissionDenied(Reason.BINDING_MISMATCH)
