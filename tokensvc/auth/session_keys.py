"""Session-memory key derivation for the Valkey State Layer (context/session-memory.md, exactly).

Layouts (namespace, agent, registry and bucket come from the verified capability, never the request):

    SESSION scope                       mem:{namespace}/{agent}:{conversation_id}
    SESSION scope, per_user capability  mem:{namespace}/{agent}:{bucket_id}:{conversation_id}
    SHARED scope, registry member       mem:shared:{registry}:{conversation_id}
    SHARED scope, namespace-qualified   mem:shared:{namespace}/{registry}:{conversation_id}
    SHARED scope, no registry           the SESSION layout above, with `downgraded` set

The documented shared layout carries no namespace: registry names must be unique across the
cluster, or two namespaces' registries of one name share a scratchpad. Clusters where they are not
turn on `shared_session_keys_per_namespace`, which qualifies the shared key with the namespace
(`qualify_shared`); off by default, because it changes every shared key the launchers use.

None of the parts may contain `/` or `:`, so the layouts cannot be confused with each other: the
conversation id is everything after the last `:`, a private key has `/` before its second `:`,
and a per-user key has exactly one more `:` than a plain one.

The conversation-id guard rejects an id that is empty, longer than 128 characters (code points),
or contains `/`, `:`, whitespace or a control character. "Control character" is read broadly:
  * Cc (C0/C1 controls, DEL, U+0085) — the documented minimum;
  * Cf format characters (U+200B zero-width space, U+FEFF BOM, U+202E and the other bidi
    controls, U+00AD soft hyphen, ...): invisible, so two ids that display identically would name
    different conversations, and bidi controls can reorder what an operator sees in logs. Ids are
    machine-generated (typically UUIDs), so no legitimate id needs them;
  * Cs lone surrogates, which cannot be encoded as UTF-8 for the Valkey key;
  * every Zs/Zl/Zp separator and everything `str.isspace` calls whitespace (NBSP, U+3000,
    U+2028, U+001C..U+001F, ...).
Private-use and unassigned code points are accepted: they cannot inject structure, and rejecting
unassigned ones would make the guard depend on the Unicode version.
"""

from __future__ import annotations

import enum
import unicodedata
from dataclasses import dataclass
from typing import Final

from tokensvc.auth.buckets import parse_bucket_version
from tokensvc.errors import InvalidArgument

__all__ = [
    "MAX_CONVERSATION_ID_LENGTH",
    "MAX_HISTORY_MESSAGES",
    "MAX_RETAINED_ENTRIES",
    "SESSION_TTL_SECONDS",
    "TTL_REFRESHED_ON_WRITE",
    "SessionKey",
    "SessionScope",
    "derive_session_key",
    "validate_conversation_id",
]

# The documented session-memory defaults, returned to launchers so they do not hard-code them.
MAX_HISTORY_MESSAGES: Final = 40  # turns the managed loop replays as prompt context
MAX_RETAINED_ENTRIES: Final = 500  # entries kept per conversation (LTRIM on append)
SESSION_TTL_SECONDS: Final = 24 * 3600  # a conversation expires 24 h after its last write
TTL_REFRESHED_ON_WRITE: Final = True  # writes refresh the TTL; reads never do

MAX_CONVERSATION_ID_LENGTH: Final = 128
_SEPARATORS: Final = frozenset("/:")
_FORBIDDEN_CATEGORIES: Final = frozenset({"Cc", "Cf", "Cs", "Zs", "Zl", "Zp"})


class SessionScope(enum.StrEnum):
    SESSION = "session"  # private to the agent (optionally per end-user)
    SHARED = "shared"  # the registry's team scratchpad


@dataclass(frozen=True)
class SessionKey:
    """A derived key and how it was chosen (mirrors DeriveSessionKeyResponse)."""

    key: str
    effective_scope: SessionScope
    downgraded: bool  # SHARED was asked for, but there is no registry: the private layout is used
    per_user: bool  # the key is isolated to the end-user's bucket


def validate_conversation_id(value: str, field: str = "conversation_id") -> str:
    """Return `value` unchanged if it is a safe key component, else raise InvalidArgument(field).

    Messages name the rule and the offending code point, never echo the value.
    """
    if not value:
        raise InvalidArgument(field, "is required")
    if len(value) > MAX_CONVERSATION_ID_LENGTH:
        raise InvalidArgument(field, f"must be at most {MAX_CONVERSATION_ID_LENGTH} characters")
    problem = _first_forbidden(value)
    if problem is not None:
        index, what = problem
        raise InvalidArgument(field, f"must not contain {what} (found at character {index})")
    return value


def derive_session_key(
    *,
    namespace: str,
    agent: str,
    registry: str | None,
    per_user: bool,
    user_bucket: str | None,
    conversation_id: str,
    scope: SessionScope,
    qualify_shared: bool = False,
) -> SessionKey:
    """The Valkey key of a conversation; pure (no I/O).

    `registry` None or "" means the agent is not a registry member (proto3's empty default), so
    SHARED silently falls back to the private layout: never a rootless `mem:shared::...` key.
    `user_bucket` is used only for the private layout of a `per_user` capability; a downgraded
    SHARED request of such an agent therefore stays per-user, or the fallback would pool users.
    SHARED ignores `per_user`: the scratchpad is one context per registry conversation that every
    member agent reads and writes, and a bucket is an HMAC over (namespace, agent, user), so each
    agent's bucket for the same user differs and a per-user shared key would never be shared.

    Raises InvalidArgument for a bad conversation id (validated first); ValueError when the
    capability-derived parts are malformed (a server-side bug, since verification checks them).
    """
    validate_conversation_id(conversation_id)
    _check_part("namespace", namespace)
    _check_part("agent", agent)
    if scope is SessionScope.SHARED and registry:
        _check_part("registry", registry)
        owner = f"{namespace}/{registry}" if qualify_shared else registry
        return SessionKey(
            key=f"mem:shared:{owner}:{conversation_id}",
            effective_scope=SessionScope.SHARED,
            downgraded=False,
            per_user=False,
        )
    downgraded = scope is SessionScope.SHARED
    if not per_user:
        key = f"mem:{namespace}/{agent}:{conversation_id}"
    else:
        if user_bucket is None:
            raise ValueError("per_user is set but no user bucket was given")
        parse_bucket_version(user_bucket)  # a bucket id never contains '/' or ':'
        key = f"mem:{namespace}/{agent}:{user_bucket}:{conversation_id}"
    return SessionKey(key=key, effective_scope=SessionScope.SESSION, downgraded=downgraded, per_user=per_user)


def _first_forbidden(value: str) -> tuple[int, str] | None:
    for index, char in enumerate(value):
        if char in _SEPARATORS:
            return index, repr(char)
        if char.isspace() or unicodedata.category(char) in _FORBIDDEN_CATEGORIES:
            return index, f"whitespace or control character U+{ord(char):04X}"
    return None


def _check_part(name: str, value: str) -> None:
    # Same character rule as the conversation id, so no part can forge a separator.
    if not value:
        raise ValueError(f"session key {name} is empty")
    if _first_forbidden(value) is not None:
        raise ValueError(f"session key {name} contains '/', ':', whitespace or a control character")
