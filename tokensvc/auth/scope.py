"""The tenant scope of a call, derived from the verified capability alone.

Servicers and storage see only this: namespace, agent, the hashed bucket, the grants. The raw
end-user id never leaves the authenticator; what storage needs of it (the bucket ids the same user
had under older pepper versions, to move rows forward) is computed here.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokensvc.auth.buckets import PepperKeyring, all_bucket_ids, bucket_id
from tokensvc.auth.capabilities import VerifiedCapability

__all__ = ["TenantScope", "scope_of"]


@dataclass(frozen=True)
class TenantScope:
    namespace: str
    agent: str
    # The bucket rows are written under: per user when the capability says so, else agent-wide.
    bucket_id: str
    # The same bucket under older pepper versions, newest first (rows there move to bucket_id).
    previous_bucket_ids: tuple[str, ...]
    # The agent-wide bucket (equal to bucket_id unless per_user).
    agent_bucket_id: str
    per_user: bool
    registry: str | None
    long_term_memory: bool
    knowledge_bases: tuple[str, ...]
    run_id: str
    jti: str
    issued_at: int
    expires_at: int


def scope_of(capability: VerifiedCapability, keyring: PepperKeyring) -> TenantScope:
    user = capability.user if capability.per_user else None
    ids = all_bucket_ids(keyring, capability.namespace, capability.agent, user)
    agent_bucket = bucket_id(keyring, capability.namespace, capability.agent, None)
    return TenantScope(
        namespace=capability.namespace,
        agent=capability.agent,
        bucket_id=ids[0],
        previous_bucket_ids=tuple(ids[1:]),
        agent_bucket_id=agent_bucket,
        per_user=capability.per_user,
        registry=capability.registry,
        long_term_memory=capability.long_term_memory,
        knowledge_bases=capability.knowledge_bases,
        run_id=capability.run_id,
        jti=capability.jti,
        issued_at=capability.issued_at,
        expires_at=capability.expires_at,
    )
