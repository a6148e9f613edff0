"""Per-user buckets: HMAC-SHA256 over length-prefixed fields under a versioned pepper keyring."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
import struct
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokensvc.auth.buckets import PepperKeyring, all_bucket_ids, bucket_id, parse_bucket_version
from tokensvc.auth.devpki import ensure_dev_material

PEPPER_1 = bytes(range(32))
PEPPER_2 = bytes(range(100, 140))
BUCKET_SHAPE = re.compile(r"v[1-9][0-9]*\.[a-z2-7]{52}")

texts = st.text(max_size=40)


def _keyring() -> PepperKeyring:
    return PepperKeyring({1: PEPPER_1})


def _write_pepper(directory: Path, name: str, secret: bytes) -> Path:
    path = directory / name
    path.write_text(base64.urlsafe_b64encode(secret).decode())
    return path


def _expected(pepper: bytes, version: int, *fields: bytes) -> str:
    """Independent reference: 4-byte big-endian length + UTF-8 bytes per field, HMAC-SHA256, base32."""
    message = b"".join(struct.pack(">I", len(f)) + f for f in fields)
    digest = hmac.new(pepper, message, hashlib.sha256).digest()
    return f"v{version}." + base64.b32encode(digest).decode().rstrip("=").lower()


# --- known answers ----------------------------------------------------------------------------


def test_user_bucket_matches_independent_hmac_of_length_prefixed_fields() -> None:
    expected = _expected(PEPPER_1, 1, b"user", b"my-team", b"support-agent", b"alice@ex.com")
    assert bucket_id(_keyring(), "my-team", "support-agent", "alice@ex.com") == expected


def test_agent_wide_bucket_matches_independent_hmac_with_agent_tag() -> None:
    expected = _expected(PEPPER_1, 1, b"agent", b"my-team", b"support-agent")
    assert bucket_id(_keyring(), "my-team", "support-agent", None) == expected


def test_non_ascii_fields_are_length_prefixed_by_utf8_byte_length() -> None:
    expected = _expected(PEPPER_1, 1, b"user", b"ns", b"agent", "Zoë ☃".encode())
    assert bucket_id(_keyring(), "ns", "agent", "Zoë ☃") == expected


def test_bucket_id_is_pinned_for_a_fixed_pepper() -> None:
    # Pinned so a refactor that changes the encoding (and would orphan every stored row) fails.
    assert (
        bucket_id(_keyring(), "my-team", "support-agent", "alice@ex.com")
        == "v1.v67aprpnrqthzsmwed7dcvfc6hsgpvwpvfre2yj74vudovsxs7mq"
    )


# --- isolation --------------------------------------------------------------------------------


def test_bucket_id_is_deterministic_and_well_formed() -> None:
    first = bucket_id(_keyring(), "ns", "agent", "u")
    assert first == bucket_id(PepperKeyring({1: PEPPER_1}), "ns", "agent", "u")
    assert BUCKET_SHAPE.fullmatch(first)


def test_different_users_agents_and_namespaces_get_different_buckets() -> None:
    keyring = _keyring()
    buckets = {
        bucket_id(keyring, "ns", "agent", "alice"),
        bucket_id(keyring, "ns", "agent", "bob"),
        bucket_id(keyring, "ns", "other-agent", "alice"),
        bucket_id(keyring, "other-ns", "agent", "alice"),
        bucket_id(keyring, "ns", "agent", None),
        bucket_id(keyring, "other-ns", "agent", None),
    }
    assert len(buckets) == 6


def test_agent_wide_bucket_differs_from_empty_user_bucket() -> None:
    assert bucket_id(_keyring(), "ns", "agent", None) != bucket_id(_keyring(), "ns", "agent", "")


@given(user=texts)
def test_agent_wide_bucket_differs_from_every_user_bucket(user: str) -> None:
    assert bucket_id(_keyring(), "ns", "agent", None) != bucket_id(_keyring(), "ns", "agent", user)


def test_different_peppers_give_different_buckets() -> None:
    other = PepperKeyring({1: PEPPER_2})
    assert bucket_id(_keyring(), "ns", "a", "u") != bucket_id(other, "ns", "a", "u")


@given(first=st.tuples(texts, texts, texts), second=st.tuples(texts, texts, texts))
def test_different_field_triples_get_different_buckets(
    first: tuple[str, str, str], second: tuple[str, str, str]
) -> None:
    keyring = _keyring()
    if first != second:
        assert bucket_id(keyring, *first) != bucket_id(keyring, *second)


@given(prefix=texts, middle=texts, suffix=texts)
def test_moving_characters_between_fields_changes_the_bucket(prefix: str, middle: str, suffix: str) -> None:
    keyring = _keyring()
    if middle:
        assert bucket_id(keyring, prefix + middle, suffix, "u") != bucket_id(
            keyring, prefix, middle + suffix, "u"
        )
        assert bucket_id(keyring, "ns", prefix + middle, suffix) != bucket_id(
            keyring, "ns", prefix, middle + suffix
        )


def test_ab_c_and_a_bc_get_different_buckets() -> None:
    keyring = _keyring()
    assert bucket_id(keyring, "ns", "ab", "c") != bucket_id(keyring, "ns", "a", "bc")
    assert bucket_id(keyring, "ab", "c", "u") != bucket_id(keyring, "a", "bc", "u")


@given(user=st.text(min_size=1, max_size=60))
def test_bucket_id_never_contains_the_user_id(user: str) -> None:
    bucket = bucket_id(_keyring(), "ns", "agent", user)
    assert BUCKET_SHAPE.fullmatch(bucket)
    if len(user) >= 8:  # very short strings can turn up inside any base32 text by chance
        assert user not in bucket
        assert user.lower() not in bucket


def test_lone_surrogate_user_is_rejected_without_quoting_it() -> None:
    with pytest.raises(ValueError, match="user") as info:
        bucket_id(_keyring(), "ns", "agent", "x\ud800y")
    assert "\ud800" not in str(info.value)
    assert info.value.__cause__ is None
    assert info.value.__suppress_context__


# --- versions ---------------------------------------------------------------------------------


def test_newest_pepper_version_is_the_default_for_new_buckets() -> None:
    keyring = PepperKeyring({1: PEPPER_1, 2: PEPPER_2})
    assert keyring.newest_version == 2
    assert keyring.versions == (1, 2)
    assert bucket_id(keyring, "ns", "a", "u") == _expected(PEPPER_2, 2, b"user", b"ns", b"a", b"u")
    assert bucket_id(keyring, "ns", "a", "u", version=1) == _expected(PEPPER_1, 1, b"user", b"ns", b"a", b"u")


def test_all_bucket_ids_lists_newest_version_first() -> None:
    keyring = PepperKeyring({1: PEPPER_1, 2: PEPPER_2})
    ids = all_bucket_ids(keyring, "ns", "a", "u")
    assert ids == [
        bucket_id(keyring, "ns", "a", "u", version=2),
        bucket_id(keyring, "ns", "a", "u", version=1),
    ]
    assert [parse_bucket_version(b) for b in ids] == [2, 1]
    # v1's bucket under a v1+v2 keyring is the bucket a v1-only keyring wrote: rows can be found.
    assert ids[1] == bucket_id(_keyring(), "ns", "a", "u")


def test_unknown_pepper_version_is_refused() -> None:
    with pytest.raises(ValueError, match="version 7"):
        bucket_id(_keyring(), "ns", "a", "u", version=7)


@pytest.mark.parametrize(
    "bad", ["", "v1", "v0.aaaa", "1.abc", "v1." + "a" * 51, "v1." + "A" * 52, "v01." + "a" * 52, "v1:x"]
)
def test_parse_bucket_version_rejects_malformed_ids(bad: str) -> None:
    with pytest.raises(ValueError, match="not a bucket id"):
        parse_bucket_version(bad)


def test_parse_bucket_version_reads_the_version() -> None:
    assert parse_bucket_version("v12." + "a" * 52) == 12


# --- keyring loading --------------------------------------------------------------------------


def test_keyring_loads_the_dev_pepper_file(tmp_path: Path) -> None:
    paths = ensure_dev_material(tmp_path / "state")
    keyring = PepperKeyring.load(paths.pepper_dir)
    assert keyring.versions == (1,)
    raw = (paths.pepper_dir / "v1").read_text()
    assert bucket_id(keyring, "ns", "a", "u") == _expected(
        base64.urlsafe_b64decode(raw), 1, b"user", b"ns", b"a", b"u"
    )


def test_keyring_tolerates_trailing_newline_and_missing_padding(tmp_path: Path) -> None:
    (tmp_path / "v1").write_text(base64.urlsafe_b64encode(PEPPER_1).decode() + "\n")
    (tmp_path / "v2").write_text(base64.urlsafe_b64encode(PEPPER_2).decode().rstrip("=") + " \r\n")
    keyring = PepperKeyring.load(tmp_path)
    assert keyring.versions == (1, 2)
    assert bucket_id(keyring, "n", "a", "u", version=1) == bucket_id(_keyring(), "n", "a", "u")
    assert bucket_id(keyring, "n", "a", "u") == bucket_id(PepperKeyring({2: PEPPER_2}), "n", "a", "u")


def test_keyring_loads_a_mounted_kubernetes_secret_layout(tmp_path: Path) -> None:
    # What the kubelet writes: a timestamped dot-directory, `..data` pointing at it, and one
    # symlink per key through `..data`.
    timestamped = tmp_path / "..2024_01_01_00_00_00.123456789"
    timestamped.mkdir()
    _write_pepper(timestamped, "v1", PEPPER_1)
    _write_pepper(timestamped, "v2", PEPPER_2)
    (tmp_path / "..data").symlink_to(timestamped.name)
    (tmp_path / "v1").symlink_to("..data/v1")
    (tmp_path / "v2").symlink_to("..data/v2")
    (tmp_path / ".hidden-editor-swap").write_text("not a pepper")
    keyring = PepperKeyring.load(tmp_path)
    assert keyring.versions == (1, 2)
    assert bucket_id(keyring, "ns", "a", None, version=1) == bucket_id(_keyring(), "ns", "a", None)


def test_keyring_repr_shows_versions_but_never_the_pepper() -> None:
    keyring = PepperKeyring({1: PEPPER_1, 2: PEPPER_2})
    for text in (repr(keyring), str(keyring), f"{keyring}"):
        assert text == "PepperKeyring(versions=(1, 2))"
        assert base64.urlsafe_b64encode(PEPPER_1).decode() not in text
        assert PEPPER_1.hex() not in text


def test_missing_pepper_directory_is_named_in_the_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=re.escape(str(missing))):
        PepperKeyring.load(missing)


def test_empty_pepper_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / ".only-a-dotfile").write_text("x")
    with pytest.raises(ValueError, match="no pepper files"):
        PepperKeyring.load(tmp_path)


@pytest.mark.parametrize("name", ["pepper", "v", "v0", "v01", "V1", "v1.txt", "v-1", "v1234567890"])
def test_pepper_file_with_a_bad_name_is_named_in_the_error(tmp_path: Path, name: str) -> None:
    _write_pepper(tmp_path, "v1", PEPPER_1)
    _write_pepper(tmp_path, name, PEPPER_2)
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / name))):
        PepperKeyring.load(tmp_path)


def test_pepper_directory_entry_that_is_a_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "v1").mkdir()
    with pytest.raises(ValueError, match="not a regular file"):
        PepperKeyring.load(tmp_path)


def _assert_refused_without_leaking(path: Path, content: bytes, match: str) -> None:
    path.write_bytes(content)
    with pytest.raises(ValueError, match=match) as info:
        PepperKeyring.load(path.parent)
    message = str(info.value)
    assert str(path) in message
    stripped = content.strip()
    if stripped:
        assert stripped.decode("latin-1") not in message
    # Nothing from a decoder (which could quote bytes) is chained into the traceback.
    assert info.value.__cause__ is None


def test_pepper_shorter_than_32_bytes_is_refused_naming_the_file(tmp_path: Path) -> None:
    short = base64.urlsafe_b64encode(os.urandom(31))
    _assert_refused_without_leaking(tmp_path / "v1", short, "fewer than 32 bytes")


@pytest.mark.parametrize(
    "content",
    [
        b"not base64 at all!!",
        base64.standard_b64encode(b"\xfb\xff" * 20),  # standard alphabet: '+' and '/'
        b"QUJD" * 11 + b"Q",  # a length no base64 text can have
        b"QUJDRA" * 8 + b"=",  # wrong padding
        b"\xff\xfe secret bytes",
        b"QUJD\nQUJD" * 6,  # an embedded newline
    ],
)
def test_pepper_that_is_not_base64url_is_refused_naming_the_file(tmp_path: Path, content: bytes) -> None:
    _assert_refused_without_leaking(tmp_path / "v2", content, "not base64url")


def test_empty_pepper_file_is_refused_naming_the_file(tmp_path: Path) -> None:
    _assert_refused_without_leaking(tmp_path / "v1", b"\n", "empty")


def test_oversized_pepper_file_is_refused(tmp_path: Path) -> None:
    _assert_refused_without_leaking(tmp_path / "v1", b"A" * 5000, "larger than")


def test_keyring_constructor_refuses_short_peppers_and_bad_versions() -> None:
    with pytest.raises(ValueError, match="at least one"):
        PepperKeyring({})
    with pytest.raises(ValueError, match="shorter than 32"):
        PepperKeyring({1: b"x" * 31})
    with pytest.raises(ValueError, match="positive"):
        PepperKeyring({0: PEPPER_1})
