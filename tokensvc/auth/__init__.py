"""Caller identity, capabilities, key sets and buckets."""

from tokensvc.auth.buckets import PepperKeyring, all_bucket_ids, bucket_id, parse_bucket_version
from tokensvc.auth.capabilities import (
    ALLOWED_ALGORITHMS,
    CAPABILITY_TYPE,
    MAX_LEEWAY_SECONDS,
    MAX_TOKEN_BYTES,
    CapabilityVerifier,
    VerifiedCapability,
    certificate_thumbprint,
    mint_capability,
)
from tokensvc.auth.keyset import TrustBundle
from tokensvc.auth.session_keys import (
    MAX_HISTORY_MESSAGES,
    MAX_RETAINED_ENTRIES,
    SESSION_TTL_SECONDS,
    TTL_REFRESHED_ON_WRITE,
    SessionKey,
    SessionScope,
    derive_session_key,
    validate_conversation_id,
)

__all__: list[str] = [
    "ALLOWED_ALGORITHMS",
    "CAPABILITY_TYPE",
    "MAX_HISTORY_MESSAGES",
    "MAX_LEEWAY_SECONDS",
    "MAX_RETAINED_ENTRIES",
    "MAX_TOKEN_BYTES",
    "SESSION_TTL_SECONDS",
    "TTL_REFRESHED_ON_WRITE",
    "CapabilityVerifier",
    "PepperKeyring",
    "SessionKey",
    "SessionScope",
    "TrustBundle",
    "VerifiedCapability",
    "all_bucket_ids",
    "bucket_id",
    "certificate_thumbprint",
    "derive_session_key",
    "mint_capability",
    "parse_bucket_version",
    "validate_conversation_id",
]
