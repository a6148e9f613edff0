"""Hostile values for the fuzz tests, beyond random ones: what broke tokensvc before (issue 14).

- hostile strings: a NUL, a line break (`\\n`, `\\r\\n`, U+2028...), an invisible or look-alike
  character, a lone surrogate (sent as its bytes on the wire, since protobuf cannot encode one) or
  a length past every limit, put into any one string field of any request (`poisoned`);
- forged page tokens: base64url JSON with every wrong type, missing, extra and repeated keys, huge
  numbers, lone-surrogate escapes, other encodings, deep nesting and oversized JSON; refs and
  numbers likewise;
- hostile capability claims: a payload to sign validly whose claims have odd values (NUL,
  newlines, surrogates, wrong types, huge arrays and numbers, nesting (past the verifier's bound
  too), extra claims and headers).
"""

from __future__ import annotations

import json
import math
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

from tests.fuzz.strategies import FORGED_TIMES, HOSTILE_JSON, NESTING_DEPTHS, listing_tag
from tests.support import AUDIENCE, ISSUER, b64url

# --- hostile strings ------------------------------------------------------------------------------

# Characters that end a line somewhere: `$` before a final "\n", str.splitlines, log formats.
LINE_BREAKS = ["\n", "\r\n", "\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]
# Characters that are there without being seen: whitespace, zero width, direction overrides.
INVISIBLE = ["\t", " ", "\u00a0", "\u200b", "\u200e", "\u202e", "\u2066", "\ufeff", "\u3000", "\u115f"]
# Lengths at and past the limits tokensvc documents (names 63/253, ids 256, users 512...).
LONG_LENGTHS = [64, 254, 257, 513, 1025, 16_385, 70_000]
# A private-use character that `with_lone_surrogates` turns into a lone surrogate's bytes
# (ED A0 80, U+D800 in CESU-8) on the wire: protobuf refuses to encode one, a hostile client
# does not. Both are three bytes, so no length prefix changes.
SURROGATE_MARK = "\ue000"
_MARK_BYTES, _SURROGATE_BYTES = SURROGATE_MARK.encode(), b"\xed\xa0\x80"
_FULL_WIDTH = {c: chr(ord(c) + 0xFEE0) for c in string.ascii_letters + string.digits + "-.@"}


def _alike(value: str) -> str:
    """A look-alike of `value` that is not `value`: full width, upper case or a combining accent."""
    for alike in (value.translate(str.maketrans(_FULL_WIDTH)), value.upper()):
        if alike != value:
            return alike
    return value + "\u0301"


@st.composite
def hostile_variant(draw: st.DrawFn, value: str, longest: int = LONG_LENGTHS[-1]) -> str:
    """`value` made hostile: a NUL, a line break, an invisible character or a lone surrogate
    before, inside, after or instead of it; grown past every limit (up to `longest`); emptied; or
    a look-alike."""
    kind = draw(
        st.sampled_from(["nul", "break", "break", "invisible", "surrogate", "long", "empty", "alike"])
    )
    if kind == "long":
        length = draw(st.sampled_from([n for n in LONG_LENGTHS if n <= longest]))
        return value + "x" * max(1, length - len(value))
    if kind in ("empty", "alike"):
        return "" if kind == "empty" else _alike(value)
    piece = draw(
        {
            "nul": st.just("\x00"),
            "break": st.sampled_from(LINE_BREAKS),
            "invisible": st.sampled_from(INVISIBLE),
            "surrogate": st.just(SURROGATE_MARK),
        }[kind]
    )
    cut = draw(st.sampled_from([len(value), len(value), 0, None]))
    if cut is None:  # inside, or instead of it
        cut = draw(st.integers(0, len(value)))
        if draw(st.booleans()):
            return piece
    return value[:cut] + piece + value[cut:]


@dataclass(frozen=True)
class Slot:
    """One string in a message: a field, an element of a repeated field, or a map key."""

    holder: Message
    field: FieldDescriptor
    index: int | None = None  # an element of a repeated string field
    key: str | None = None  # a key of a map field

    @property
    def path(self) -> str:
        suffix = (
            f"[{self.index}]" if self.index is not None else f"[{self.key!r}]" if self.key is not None else ""
        )
        return f"{self.holder.DESCRIPTOR.name}.{self.field.name}{suffix}"

    def read(self) -> str:
        if self.key is not None:
            return self.key
        value = getattr(self.holder, self.field.name)
        return str(value if self.index is None else value[self.index])

    def write(self, text: str) -> None:
        if self.key is not None:
            entries = getattr(self.holder, self.field.name)
            kept = type(entries[self.key])()
            kept.CopyFrom(entries[self.key])
            del entries[self.key]
            entries[text].CopyFrom(kept)
        elif self.index is not None:
            getattr(self.holder, self.field.name)[self.index] = text
        else:
            setattr(self.holder, self.field.name, text)


def string_slots(message: Message) -> list[Slot]:
    """Every string `message` holds or could hold at the levels it has: each string field (set or
    not), each element of a repeated one, each map key, recursively through present messages."""
    slots: list[Slot] = []
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.type == FieldDescriptor.TYPE_STRING:
            if field.is_repeated:
                slots += [Slot(message, field, index=i) for i in range(len(value))]
            else:
                slots.append(Slot(message, field))
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            if field.message_type.GetOptions().map_entry:
                for key in list(value):
                    slots.append(Slot(message, field, key=key))
                    slots += string_slots(value[key])
            elif field.is_repeated:
                for element in value:
                    slots += string_slots(element)
            elif message.HasField(field.name):
                slots += string_slots(value)
    return slots


@st.composite
def poisoned(draw: st.DrawFn, messages: list[Message]) -> tuple[list[Message], str]:
    """`messages` (a request, or the messages of a stream) with one string made hostile, and the
    path of that string. Messages with no string at all come back as they are."""
    copies = []
    for message in messages:
        copy = type(message)()
        copy.CopyFrom(message)
        copies.append(copy)
    slots = [slot for copy in copies for slot in string_slots(copy)]
    if not slots:
        return copies, ""
    slot = draw(st.sampled_from(slots))
    slot.write(draw(hostile_variant(slot.read())))
    return copies, slot.path


def with_lone_surrogates(message: Message) -> bytes:
    """The wire bytes of `message` with every `SURROGATE_MARK` turned into a lone surrogate."""
    return message.SerializeToString().replace(_MARK_BYTES, _SURROGATE_BYTES)


def carries_surrogate_mark(message: Message) -> bool:
    return _MARK_BYTES in message.SerializeToString()


# --- forged page tokens ---------------------------------------------------------------------------

# Numbers JSON can carry and Python parses: past int64, past float, and a 4,000-digit integer
# (Python refuses to parse more than 4,300 digits).
HUGE_NUMBERS = st.sampled_from([2**63, -(2**63) - 1, 2**64, 10**30, 10**308, 10**4000, 1e308, -1e308])
LONE_SURROGATE_TEXT = st.text(
    st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3
)
JSON_TEXT = st.one_of(
    st.text(max_size=20),  # lone surrogates included: JSON escapes them as \\ud800
    LONE_SURROGATE_TEXT.map(lambda s: f"a{s}b"),
    st.sampled_from(["", "\x00", "a\n", "\u2028", "x" * 600]),
)
JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    HUGE_NUMBERS,
    st.floats(),  # NaN and infinities too: Python's json writes and reads them
    JSON_TEXT,
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(JSON_TEXT, inner, max_size=3),
    max_leaves=8,
)


def json_bytes(value: Any, encoding: str) -> bytes:
    """`value` as JSON text in one of the encodings a forger might choose (only `ascii` is what
    a well-behaved encoder sends: lone surrogates escaped)."""
    if encoding == "ascii":
        return json.dumps(value).encode()
    text = json.dumps(value, ensure_ascii=False)
    if encoding == "utf-16":
        return text.encode("utf-16", "surrogatepass")
    if encoding == "bom":
        return b"\xef\xbb\xbf" + text.encode("utf-8", "surrogatepass")
    return text.encode("utf-8", "surrogatepass")  # raw: a lone surrogate is invalid UTF-8


@st.composite
def forged_json_tokens(draw: st.DrawFn, good: dict[str, st.SearchStrategy[Any]]) -> str:
    """base64url of JSON shaped like a token with the keys of `good`: each key's value right (from
    `good`) or of any other type, keys missing, extra keys, repeated keys; or JSON that is no
    object at all, deeply nested, or not valid UTF-8."""
    shape = draw(st.sampled_from(["object", "object", "object", "not an object", "nested", "repeated"]))
    if shape == "not an object":
        body: Any = draw(JSON_VALUES)
    elif shape == "nested":  # or oversized
        return b64url(draw(HOSTILE_JSON))
    else:
        body = {}
        for key, right in good.items():
            choice = draw(st.sampled_from(["right", "right", "wrong", "missing"]))
            if choice == "right":
                body[key] = draw(right)
            elif choice == "wrong":
                body[key] = draw(JSON_VALUES)
        body.update(draw(st.dictionaries(JSON_TEXT, JSON_VALUES, max_size=2)))
        if shape == "repeated" and good:
            # The same key twice (a parser keeps one of them): written by hand, JSON objects cannot.
            key = draw(st.sampled_from(sorted(good)))
            again = json.dumps(key).encode() + b": " + json_bytes(draw(good[key] | JSON_VALUES), "ascii")
            opened = json_bytes(body, "ascii")[:-1]
            return b64url(opened + (b", " if body else b"") + again + b"}")
    encoding = draw(st.sampled_from(["ascii", "ascii", "ascii", "raw", "utf-16", "bom"]))
    return b64url(json_bytes(body, encoding))


def memory_token_values(filter_bytes: bytes) -> dict[str, st.SearchStrategy[Any]]:
    """The right value of each key of a ListMemories token bound to `filter_bytes`."""
    tag = listing_tag(filter_bytes)
    return {
        "c": FORGED_TIMES | st.datetimes().map(lambda d: d.isoformat() + "+00:00"),
        "i": st.uuids().map(str),
        "f": st.just(tag) | st.text(st.sampled_from("0123456789abcdef"), min_size=16, max_size=16),
    }


def ref_token_values(*listing: bytes | str) -> dict[str, st.SearchStrategy[Any]]:
    """The keys of a ListKnowledgeBases / ListDocuments token for this listing: `r` a hostile ref
    (a lone surrogate or NUL among them, which JSON escapes carry), `f` the listing's right tag."""
    refs = st.one_of(
        st.sampled_from(["handbook.md", "kb-fuzz-a", "a"]).flatmap(hostile_variant).map(_surrogates),
        st.sampled_from(["\ud800", "a\udfff", "\x00", "", "x" * 513]),
        st.text(max_size=40),
    )
    tag = listing_tag(*listing)
    return {
        "r": refs,
        "f": st.just(tag) | st.text(st.sampled_from("0123456789abcdef"), min_size=16, max_size=16),
    }


def _surrogates(text: str) -> str:
    return text.replace(SURROGATE_MARK, "\ud800")


def text_page_tokens() -> st.SearchStrategy[str]:
    """base64url of text, as a ref token was before tokens became JSON bound to their listing:
    hostile refs (a real lone surrogate among them), random text, bytes that are no UTF-8, a ref
    past every limit."""
    refs = st.one_of(
        st.sampled_from(["handbook.md", "kb-fuzz-a", "a"]).flatmap(hostile_variant).map(_surrogates),
        st.text(max_size=40),
        st.sampled_from([{"c": 1}, ["a"], "\x00"]).map(json.dumps),
    )
    raw = st.sampled_from([b"\xed\xa0\x80", b"\xff\xfe", b"x" * 513, b"\xef\xbb\xbfhandbook.md"])
    return st.one_of(refs.map(lambda text: text.encode("utf-8", "surrogatepass")), raw).map(b64url)


NUMBER_PAGE_TOKENS = st.one_of(
    st.sampled_from(
        ["1\n", "\n1", " 1", "1 ", "+1", "-1", "0x10", "1e3", "1_000", "\u0661", "\uff11", "0" * 400]
    ),
    st.integers(-(2**70), 2**70).map(str),
    st.integers(1, 10**6).flatmap(lambda n: hostile_variant(str(n))),
)


# --- hostile capability claims --------------------------------------------------------------------

IDENTIFIERS = st.one_of(
    st.sampled_from(["run-1", "a", "x" * 256, "é", "😀", "a b", "\tx", "a\nb", "a\n", "x\u2028", "\u00a0x"]),
    st.sampled_from(["", " ", "\t", "\u3000", "\n", "\x00", "a\x00", "\ud800", "a\udfff", "x" * 257]),
    st.text(max_size=12, min_size=1),
)
TYPE_CONFUSION = st.sampled_from(
    [None, True, False, 0, 1, -1, 1.5, math.nan, math.inf, "", "1", [], ["a"], {}, {"a": 1}, [[[]]], 10**30]
)


def _claim_variant(value: str) -> st.SearchStrategy[str]:
    # Short enough that three long claims and a huge array stay under gRPC's 32 KiB metadata
    # budget: past it gRPC itself sheds the call, before tokensvc sees it.
    return hostile_variant(value, longest=1025)


def hostile_claim_values(namespace: str, agent: str, canary_user: str, kbs: list[str]) -> dict[str, Any]:
    """For each claim, a strategy of odd values a control plane could sign by mistake (or a forger
    with a stolen key by intent). Wrong types everywhere; near misses of the right values."""
    near = st.sampled_from([namespace, agent, "kb-fuzz-a", canary_user]).flatmap(_claim_variant)
    surrogate = st.sampled_from([f"a\ud800{namespace}", "\udfff", f"{canary_user}\ud83d"])
    times = st.one_of(
        st.integers(-(2**40), 2**40),
        HUGE_NUMBERS,
        st.floats(),
        st.sampled_from([0, 253402300799, 253402300800]),
        TYPE_CONFUSION,
    )
    return {
        "sub": IDENTIFIERS | TYPE_CONFUSION | surrogate,
        "jti": IDENTIFIERS | TYPE_CONFUSION | surrogate,
        "user": st.one_of(
            IDENTIFIERS,
            st.just(canary_user).flatmap(_claim_variant),  # look-alikes of the canary end-user
            st.sampled_from(["u" * 512, "u" * 513, "\u202euser", "user\r\n\r\nX-Injected: 1"]),
            surrogate,
            TYPE_CONFUSION,
        ),
        "per_user": st.booleans() | TYPE_CONFUSION,
        "ltm": st.booleans() | TYPE_CONFUSION,
        "ns": st.one_of(st.just(namespace), near, surrogate, TYPE_CONFUSION),
        "agent": st.one_of(st.just(agent), near, surrogate, TYPE_CONFUSION),
        "registry": st.one_of(
            st.sampled_from(["support", "a" * 63, "a" * 64, "a_b", "Support"]), near, TYPE_CONFUSION
        ),
        "kbs": st.one_of(
            st.lists(st.sampled_from(kbs), max_size=3),
            st.just([f"kb-{i}" for i in range(64)]),  # the most a capability may grant
            st.just([f"kb-{i}" for i in range(65)]),
            st.just([f"kb-{i}" for i in range(1000)]),  # a huge array (and past 8 KiB)
            st.just(kbs[:1] * 2),
            st.lists(near | TYPE_CONFUSION | JSON_TEXT, min_size=1, max_size=3),
            st.just("kb-fuzz-a"),
            TYPE_CONFUSION,
        ),
        "cnf": st.one_of(
            st.builds(lambda t: {"x5t#S256": t}, st.just("A" * 43).flatmap(_claim_variant) | TYPE_CONFUSION),
            st.just({"x5t#S256": "A" * 43, "x5t": "A" * 27}),
            TYPE_CONFUSION,
        ),
        "iat": times,
        "nbf": times,
        "exp": times,
        "iss": st.one_of(st.just(ISSUER).flatmap(_claim_variant), st.just([ISSUER]), TYPE_CONFUSION),
        "aud": st.one_of(
            st.just(AUDIENCE).flatmap(_claim_variant), st.just([AUDIENCE, AUDIENCE]), TYPE_CONFUSION
        ),
    }


@dataclass(frozen=True)
class HostileToken:
    header: dict[str, Any]
    payload: bytes  # JSON, as signed
    changed: tuple[str, ...]  # which claims were altered, for the failure message


@st.composite
def hostile_tokens(
    draw: st.DrawFn, base: Callable[[], dict[str, Any]], values: dict[str, Any], header: dict[str, Any]
) -> HostileToken:
    """A capability payload: the valid claims `base()` with one to three claims given odd values
    or removed, sometimes an extra claim of any shape, in one of several JSON encodings."""
    claims = base()
    # One odd claim mostly, so that more tokens pass and the odd value reaches the RPC behind.
    count = draw(st.sampled_from([1, 1, 1, 2, 3]))
    changed = draw(st.lists(st.sampled_from(sorted(values)), min_size=count, max_size=count, unique=True))
    for name in changed:
        if draw(st.integers(1, 10)) == 1:
            claims.pop(name, None)
        else:
            claims[name] = draw(values[name])
    if draw(st.integers(1, 5)) == 1:
        extra = draw(st.sampled_from(["crit", "jwk", "x", "ns ", "NS", "\u0000", "cnf\n"]) | JSON_TEXT)
        claims[extra] = draw(JSON_VALUES | st.just([0] * 2000) | st.just(_nested(400)))
    encoding = draw(st.sampled_from(["ascii"] * 8 + ["raw", "utf-16"]))
    odd_header = dict(header)
    if draw(st.integers(1, 10)) == 1:
        odd_header[draw(st.sampled_from(["typ", "kid", "crit", "cty", "b64"]))] = draw(JSON_VALUES)
    payload = json_bytes(claims, encoding)
    if encoding == "ascii" and draw(st.integers(1, 10)) == 1:
        # A member nested past the verifier's bound, written by hand (json.dumps recurses too).
        depth = draw(st.sampled_from(NESTING_DEPTHS))
        payload = payload[:-1] + b', "deep": ' + b"[" * depth + b"]" * depth + b"}"
    return HostileToken(odd_header, payload, tuple(changed))


def _nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value
