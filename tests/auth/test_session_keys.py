"""Session-memory keys: the layouts of context/session-memory.md and the conversationId guard."""

from __future__ import annotations

import dataclasses
import unicodedata

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from tokensvc.auth.buckets import PepperKeyring, bucket_id
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
from tokensvc.errors import InvalidArgument, Reason

BUCKET = "v1." + "a" * 52
KEYRING = PepperKeyring({1: bytes(range(32))})

# A character is forbidden when it is '/' or ':', whitespace, or a control/format/surrogate/
# separator code point. The tests state the rule independently of the implementation.
_FORBIDDEN_CATEGORIES = {"Cc", "Cf", "Cs", "Zs", "Zl", "Zp"}


def _forbidden(char: str) -> bool:
    return char in "/:" or char.isspace() or unicodedata.category(char) in _FORBIDDEN_CATEGORIES


forbidden_chars = st.characters().filter(_forbidden)
allowed_chars = st.characters().filter(lambda c: not _forbidden(c))
valid_ids = st.text(alphabet=allowed_chars, min_size=1, max_size=128)


def _derive(
    conversation_id: str = "conv-1",
    *,
    scope: SessionScope = SessionScope.SESSION,
    registry: str | None = None,
    per_user: bool = False,
    user_bucket: str | None = None,
    namespace: str = "my-team",
    agent: str = "support-agent",
    qualify_shared: bool = False,
) -> SessionKey:
    return derive_session_key(
        qualify_shared=qualify_shared,
        namespace=namespace,
        agent=agent,
        registry=registry,
        per_user=per_user,
        user_bucket=user_bucket,
        conversation_id=conversation_id,
        scope=scope,
    )


# --- layouts, character for character ---------------------------------------------------------


def test_session_scope_key_is_namespace_slash_agent_colon_conversation() -> None:
    assert _derive("conv-1") == SessionKey(
        key="mem:my-team/support-agent:conv-1",
        effective_scope=SessionScope.SESSION,
        downgraded=False,
        per_user=False,
    )


def test_shared_scope_with_registry_keys_the_registry_scratchpad() -> None:
    assert _derive("conv-1", scope=SessionScope.SHARED, registry="team-reg") == SessionKey(
        key="mem:shared:team-reg:conv-1",
        effective_scope=SessionScope.SHARED,
        downgraded=False,
        per_user=False,
    )


def test_by_default_the_shared_key_of_a_registry_is_the_same_in_every_namespace() -> None:
    # The documented layout: registry names must be unique across the cluster (docs/capabilities.md).
    keys = {
        _derive("c", scope=SessionScope.SHARED, registry="support-registry", namespace=namespace).key
        for namespace in ("default", "team-b")
    }
    assert keys == {"mem:shared:support-registry:c"}


def test_qualified_shared_keys_separate_namespaces_and_cannot_collide_with_other_layouts() -> None:
    def shared(namespace: str) -> str:
        return _derive(
            "c",
            scope=SessionScope.SHARED,
            registry="support-registry",
            namespace=namespace,
            qualify_shared=True,
        ).key

    assert shared("default") == "mem:shared:default/support-registry:c"
    assert shared("team-b") == "mem:shared:team-b/support-registry:c"
    private = _derive("c", namespace="shared", agent="support-registry").key
    assert private == "mem:shared/support-registry:c"  # a namespace named "shared" still differs
    assert private not in {shared("default"), shared("shared")}


@pytest.mark.parametrize("registry", [None, ""])
def test_shared_scope_without_registry_silently_keeps_the_private_layout(registry: str | None) -> None:
    assert _derive("conv-1", scope=SessionScope.SHARED, registry=registry) == SessionKey(
        key="mem:my-team/support-agent:conv-1",
        effective_scope=SessionScope.SESSION,
        downgraded=True,
        per_user=False,
    )


def test_per_user_session_key_inserts_the_bucket_before_the_conversation() -> None:
    assert _derive("conv-1", per_user=True, user_bucket=BUCKET) == SessionKey(
        key=f"mem:my-team/support-agent:v1.{'a' * 52}:conv-1",
        effective_scope=SessionScope.SESSION,
        downgraded=False,
        per_user=True,
    )


def test_shared_scope_ignores_per_user() -> None:
    assert _derive(
        "conv-1", scope=SessionScope.SHARED, registry="team-reg", per_user=True, user_bucket=BUCKET
    ) == (
        SessionKey(
            key="mem:shared:team-reg:conv-1",
            effective_scope=SessionScope.SHARED,
            downgraded=False,
            per_user=False,
        )
    )


def test_downgraded_shared_scope_of_a_per_user_agent_stays_per_user() -> None:
    # Falling back to the agent-wide key would pool every user's history into one conversation.
    assert _derive("conv-1", scope=SessionScope.SHARED, per_user=True, user_bucket=BUCKET) == SessionKey(
        key=f"mem:my-team/support-agent:{BUCKET}:conv-1",
        effective_scope=SessionScope.SESSION,
        downgraded=True,
        per_user=True,
    )


def test_registry_is_ignored_for_session_scope() -> None:
    assert _derive("c", registry="team-reg").key == "mem:my-team/support-agent:c"


def test_two_users_on_the_same_conversation_get_different_keys() -> None:
    alice = bucket_id(KEYRING, "my-team", "support-agent", "alice")
    bob = bucket_id(KEYRING, "my-team", "support-agent", "bob")
    assert (
        _derive("c", per_user=True, user_bucket=alice).key != _derive("c", per_user=True, user_bucket=bob).key
    )


def test_per_user_without_a_bucket_is_a_server_error_not_a_shared_key() -> None:
    with pytest.raises(ValueError, match="bucket"):
        _derive("c", per_user=True)


@pytest.mark.parametrize("bucket", ["alice", "v1.abc:x", "v1/" + "a" * 52, ""])
def test_per_user_with_a_malformed_bucket_is_refused(bucket: str) -> None:
    with pytest.raises(ValueError, match="bucket"):
        _derive("c", per_user=True, user_bucket=bucket)


@pytest.mark.parametrize(
    ("part", "value"),
    [("namespace", "a/b"), ("agent", "a:b"), ("agent", ""), ("registry", "r:x"), ("namespace", "a b")],
)
def test_malformed_capability_parts_cannot_forge_key_structure(part: str, value: str) -> None:
    parts = {"namespace": "ns", "agent": "agent", "registry": "reg"} | {part: value}
    with pytest.raises(ValueError, match=part):
        derive_session_key(
            namespace=parts["namespace"],
            agent=parts["agent"],
            registry=parts["registry"],
            per_user=False,
            user_bucket=None,
            conversation_id="c",
            scope=SessionScope.SHARED if part == "registry" else SessionScope.SESSION,
        )


def test_documented_defaults() -> None:
    assert MAX_HISTORY_MESSAGES == 40
    assert MAX_RETAINED_ENTRIES == 500
    assert SESSION_TTL_SECONDS == 86_400
    assert TTL_REFRESHED_ON_WRITE is True


def test_session_key_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        _derive().key = "mem:other"  # type: ignore[misc]


# --- the conversationId guard -----------------------------------------------------------------


BAD_IDS = [
    pytest.param("", id="empty"),
    pytest.param("x" * 129, id="129-chars"),
    pytest.param("é" * 129, id="129-code-points"),
    pytest.param("a/b", id="slash"),
    pytest.param("a:b", id="colon"),
    pytest.param("../etc", id="dot-dot-slash"),
    pytest.param("a b", id="space"),
    pytest.param("a\tb", id="tab"),
    pytest.param("a\nb", id="newline"),
    pytest.param("a\rb", id="carriage-return"),
    pytest.param("a\x0bb", id="vertical-tab"),
    pytest.param("a\x0cb", id="form-feed"),
    pytest.param("a\x00b", id="nul"),
    pytest.param("a\x1bb", id="escape"),
    pytest.param("a\x1fb", id="unit-separator"),
    pytest.param("a\x7fb", id="del"),
    pytest.param("a\x85b", id="next-line-U+0085"),
    pytest.param("a\x9bb", id="c1-csi"),
    pytest.param("a\xa0b", id="nbsp"),
    pytest.param("a\u1680b", id="ogham-space"),
    pytest.param("a\u2003b", id="em-space"),
    pytest.param("a\u2028b", id="line-separator-U+2028"),
    pytest.param("a\u2029b", id="paragraph-separator"),
    pytest.param("a\u202fb", id="narrow-nbsp"),
    pytest.param("a\u3000b", id="ideographic-space-U+3000"),
    pytest.param("a\u200bb", id="zero-width-space-Cf"),
    pytest.param("\ufeffab", id="bom-Cf"),
    pytest.param("ab\u202e", id="rtl-override-Cf"),
    pytest.param("a\u2066b", id="bidi-isolate-Cf"),
    pytest.param("a\xadb", id="soft-hyphen-Cf"),
    pytest.param("a\ud800b", id="lone-surrogate"),
    pytest.param(" conv", id="leading-space"),
    pytest.param("conv\n", id="trailing-newline"),
]


@pytest.mark.parametrize("bad", BAD_IDS)
def test_guard_rejects_bad_conversation_id_naming_the_field(bad: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        validate_conversation_id(bad)
    assert info.value.field == "conversation_id"
    assert info.value.reason is Reason.INVALID_ARGUMENT
    assert info.value.message.startswith("conversation_id: ")


@pytest.mark.parametrize("bad", BAD_IDS)
def test_derive_session_key_rejects_bad_conversation_id_in_every_scope(bad: str) -> None:
    for scope in SessionScope:
        with pytest.raises(InvalidArgument) as info:
            _derive(bad, scope=scope, registry="reg", per_user=True, user_bucket=BUCKET)
        assert info.value.field == "conversation_id"


def test_guard_names_the_given_field() -> None:
    with pytest.raises(InvalidArgument) as info:
        validate_conversation_id("a:b", field="request.conversation_id")
    assert info.value.field == "request.conversation_id"


def test_guard_error_does_not_echo_the_value() -> None:
    with pytest.raises(InvalidArgument) as info:
        validate_conversation_id("secret-looking-value:x")
    assert "secret-looking-value" not in info.value.message


@pytest.mark.parametrize(
    "good",
    [
        "x" * 128,
        "é" * 128,  # 128 code points, 256 UTF-8 bytes: the limit counts characters
        "😀" * 128,
        "3f2504e0-4f89-11d3-9a0c-0305e82c3301",
        "a",
        "conv_1.2-x~y@z+w=q",
        "Zoë-会話",
        "\ue000private-use",
    ],
)
def test_guard_accepts_valid_conversation_ids(good: str) -> None:
    assert validate_conversation_id(good) == good
    assert _derive(good).key == f"mem:my-team/support-agent:{good}"


@given(prefix=st.text(max_size=60), bad=forbidden_chars, suffix=st.text(max_size=60))
def test_any_id_containing_a_forbidden_character_is_rejected(prefix: str, bad: str, suffix: str) -> None:
    with pytest.raises(InvalidArgument):
        validate_conversation_id(prefix + bad + suffix)


@given(st.text(alphabet=allowed_chars, min_size=129, max_size=300))
def test_any_id_longer_than_128_characters_is_rejected(value: str) -> None:
    with pytest.raises(InvalidArgument):
        validate_conversation_id(value)


@given(valid_ids)
def test_any_accepted_id_yields_exactly_the_documented_layouts(conversation_id: str) -> None:
    assert validate_conversation_id(conversation_id) == conversation_id
    expectations = [
        (_derive(conversation_id), "mem:my-team/support-agent"),
        (_derive(conversation_id, per_user=True, user_bucket=BUCKET), f"mem:my-team/support-agent:{BUCKET}"),
        (_derive(conversation_id, scope=SessionScope.SHARED, registry="team-reg"), "mem:shared:team-reg"),
        (_derive(conversation_id, scope=SessionScope.SHARED), "mem:my-team/support-agent"),
    ]
    for derived, prefix in expectations:
        assert derived.key.endswith(f":{conversation_id}")
        assert derived.key == f"{prefix}:{conversation_id}"
        # The conversation id is everything after the last ':'; nothing it holds can add a part.
        assert derived.key.rsplit(":", 1) == [prefix, conversation_id]


@given(first=valid_ids, second=valid_ids, per_user=st.booleans(), shared=st.booleans())
def test_different_conversation_ids_never_share_a_key(
    first: str, second: str, per_user: bool, shared: bool
) -> None:
    assume(first != second)
    scope = SessionScope.SHARED if shared else SessionScope.SESSION
    first_key = _derive(first, scope=scope, registry="reg", per_user=per_user, user_bucket=BUCKET).key
    second_key = _derive(second, scope=scope, registry="reg", per_user=per_user, user_bucket=BUCKET).key
    assert first_key != second_key


@given(conversation_id=valid_ids)
def test_layouts_never_collide_with_each_other(conversation_id: str) -> None:
    keys = {
        _derive(conversation_id).key,
        _derive(conversation_id, per_user=True, user_bucket=BUCKET).key,
        _derive(conversation_id, scope=SessionScope.SHARED, registry="my-team").key,
        derive_session_key(
            namespace="shared",
            agent="my-team",
            registry=None,
            per_user=False,
            user_bucket=None,
            conversation_id=conversation_id,
            scope=SessionScope.SESSION,
        ).key,
    }
    assert len(keys) == 4


# At least 8 characters: very short strings can turn up inside any base32 text or the fixed prefix
# by chance (drawn that long, not filtered: filtering most examples fails Hypothesis' health check).
@given(user=st.text(min_size=8, max_size=64), conversation_id=valid_ids)
def test_per_user_key_never_contains_the_raw_user_id(user: str, conversation_id: str) -> None:
    assume(user not in conversation_id)
    bucket = bucket_id(KEYRING, "my-team", "support-agent", user)
    key = _derive(conversation_id, per_user=True, user_bucket=bucket).key
    assert user not in key
    assert key == f"mem:my-team/support-agent:{bucket}:{conversation_id}"
