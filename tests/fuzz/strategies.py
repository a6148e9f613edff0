"""Hypothesis strategies for fuzzing tokensvc's requests: values, not calls (see rpcs.py for one
request per RPC, target.py for the live server).

- scalars, texts, sizes, enum numbers, floats, durations, timestamps and vectors, valid mostly;
- metadata maps and filter trees of any shape;
- page tokens: mutations of real ones, random bytes, and forged base64url JSON with every wrong
  type, missing and extra keys, huge numbers, lone-surrogate escapes and deep nesting;
- hostile strings: a NUL, a line break (`\\n`, `\\r\\n`, U+2028...), an invisible character, a lone
  surrogate (sent as its bytes on the wire, since protobuf cannot encode one) or a length past every
  limit, put into any one string field of any request (`poison`);
- hostile capability claims: a validly signed payload whose claims have odd values (NUL, newlines,
  surrogates, wrong types, huge arrays and numbers, nesting, extra claims);
- raw wire bytes: truncated, appended, unknown fields, filters nested past protobuf's limit.
"""

from __future__ import annotations

import hashlib
import json
import math
import string
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf import duration_pb2, timestamp_pb2
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz.target import DIMENSION, MAX_UPLOAD
from tests.support import AUDIENCE, ISSUER, b64url
from tokensvc.v1 import common_pb2


def fuzz_settings(max_examples: int) -> settings:
    """Hypothesis settings of the live fuzz tests: no deadline (a call may wait on the database),
    no example database (the server's state differs between runs anyway)."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.function_scoped_fixture,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
        ],
    )


def fuzzed(examples: int) -> Callable[[Callable[..., Awaitable[None]]], Callable[..., Awaitable[None]]]:
    """A live property test of `examples` examples: `body` takes `data` (Hypothesis' st.data()).
    One body can so make a modest test for every run and a deep one marked slow."""

    def decorate(body: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
        return fuzz_settings(examples)(given(data=st.data())(body))

    return decorate


# --- scalars ----------------------------------------------------------------------------------


def mostly(valid: st.SearchStrategy[Any], other: st.SearchStrategy[Any], percent: int = 85) -> Any:
    """`valid` about `percent`% of the time, else `other`: most requests get past the first check."""
    return st.integers(1, 100).flatmap(lambda n: valid if n <= percent else other)


UNICODE = st.characters(exclude_categories=("Cs",))  # protobuf strings are valid UTF-8
EDGE_STRINGS = [
    "",
    " ",
    "\x00",
    "a\x00b",
    "\t\r\n",
    "\u202e\u2066rtl",
    "\ufeffbom",
    "\uffff\ufffe",
    "\U0010ffff",
    "😀" * 8,
    "e\u0301",
    "\u0130\u0131\u00df",
    "١٢٣",
    "²³",
    "../../etc/passwd",
    "' OR '1'='1' --",
    "%s%n%x",
    "${jndi:ldap://x}",
    "*",
    ",",
    "a,b",
    "\\",
    '"',
    "null",
    "NaN",
    "-1",
    "0",
    "1e309",
    "9" * 25,
    "v1.abc",
    "default",
    "spiffe://dev.local/ns/default/sa/dev-agent",
    "x" * 129,
    "y" * 257,
    "z" * 1025,
]
SMALL_TEXT = st.text(UNICODE, max_size=24) | st.sampled_from(EDGE_STRINGS)
HUGE_TEXT = st.sampled_from([33 * 1024, 70_000, 400_000]).map(lambda n: "é" * (n // 2))
RANDOM_TEXT = st.one_of(st.text(UNICODE, max_size=64), st.sampled_from(EDGE_STRINGS), HUGE_TEXT)


def texts(*known: str) -> st.SearchStrategy[str]:
    """A known-good value most of the time (when given), else random, edge-case or huge text."""
    return mostly(st.sampled_from(known), RANDOM_TEXT) if known else RANDOM_TEXT


def printable(max_size: int = 40) -> st.SearchStrategy[str]:
    return st.text(st.sampled_from(string.printable[:95]), max_size=max_size)


INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
EDGE_INTS = st.sampled_from([-1, 0, 1, 99, 100, 101, 500, 501, 2**31 - 1, -(2**31)])


def sizes() -> st.SearchStrategy[int]:
    """Page sizes and top_k: mostly sensible, sometimes at or past the caps, or anything."""
    return mostly(st.integers(0, 20), EDGE_INTS | INT32)


def enums(*values: int) -> st.SearchStrategy[int]:
    """Known enum numbers mostly; else UNSPECIFIED (0) or any number, mostly unknown ones."""
    return mostly(st.sampled_from(values), st.just(0) | INT32)


DOUBLES = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
    [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e308, -1e308, 5e-324, 2.0**53 + 1]
)
FLOAT32 = st.floats(width=32, allow_nan=True, allow_infinity=True) | st.sampled_from(
    [math.nan, math.inf, -math.inf, 0.0, -1.0, 1.0, 2.0]
)
DURATIONS = mostly(
    st.builds(duration_pb2.Duration, seconds=st.integers(1, 86_400)),
    st.builds(
        duration_pb2.Duration,
        seconds=st.sampled_from([0, 315_360_000, 315_360_001, -1]) | INT64,
        nanos=st.sampled_from([0, 1, 999_999_999, 1_000_000_000, -1]) | INT32,
    ),
)
TIMESTAMPS = mostly(
    st.builds(timestamp_pb2.Timestamp, seconds=st.integers(0, 4_000_000_000)),
    st.builds(
        timestamp_pb2.Timestamp,
        seconds=st.sampled_from([253_402_300_799, 253_402_300_800, -62_135_596_800, -62_135_596_801]) | INT64,
        nanos=st.sampled_from([0, 1, 999_999_999, 1_000_000_000, -1]) | INT32,
    ),
)


def vector_from(seed: int, kind: str) -> bytes:
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(DIMENSION).astype("<f4")
    if kind == "nan":
        values[seed % DIMENSION] = np.nan
    elif kind == "inf":
        values[seed % DIMENSION] = np.inf
    elif kind == "zero":
        values[:] = 0
    elif kind == "huge":
        values[:] = np.float32(3e38)
    elif kind == "tiny":
        values[:] = np.float32(1e-45)
    elif kind == "short":
        values = values[: seed % DIMENSION]
    elif kind == "long":
        values = np.concatenate([values, values])
    return values.tobytes()


VECTORS = mostly(
    st.builds(vector_from, st.integers(0, 2**32), st.just("ok")),
    st.one_of(
        st.binary(max_size=64),
        st.integers(0, 4096).flatmap(lambda n: st.binary(min_size=n, max_size=n)),
        st.builds(
            vector_from,
            st.integers(0, 2**32),
            st.sampled_from(["nan", "inf", "zero", "huge", "tiny", "short", "long"]),
        ),
    ),
    50,
)


# --- metadata and filters ---------------------------------------------------------------------

GOOD_KEYS = st.sampled_from(["n", "topic", "a.b", "x-y", "_k", "k" * 64])
KEYS = mostly(GOOD_KEYS, st.sampled_from(["k" * 65, "", "a b", "é", "a\x00"]) | st.text(UNICODE, max_size=12))
GOOD_VALUES = st.one_of(
    st.builds(
        common_pb2.MetadataValue, string_value=st.text(UNICODE.filter(lambda c: c != "\x00"), max_size=20)
    ),
    st.builds(common_pb2.MetadataValue, number_value=st.floats(allow_nan=False, allow_infinity=False)),
    st.builds(common_pb2.MetadataValue, bool_value=st.booleans()),
)
METADATA_VALUES = mostly(
    GOOD_VALUES,
    st.one_of(
        st.builds(common_pb2.MetadataValue, string_value=SMALL_TEXT),
        st.builds(common_pb2.MetadataValue, string_value=st.sampled_from(["z" * 1025, "é" * 600])),
        st.builds(common_pb2.MetadataValue, number_value=DOUBLES),
        st.just(common_pb2.MetadataValue()),
    ),
)
METADATA_MAPS = mostly(
    st.dictionaries(GOOD_KEYS, GOOD_VALUES, max_size=4),
    st.one_of(
        st.dictionaries(KEYS, METADATA_VALUES, max_size=6),
        st.dictionaries(KEYS, METADATA_VALUES, min_size=30, max_size=80),
    ),
)
OPERATORS = enums(*range(1, 10))


@st.composite
def filter_trees(draw: st.DrawFn, max_depth: int = 12, max_width: int = 80) -> common_pb2.Filter:
    """Any Filter message: leaves with random keys, operators and values; AND/OR/NOT nodes up to
    `max_depth` deep and `max_width` wide (a node budget keeps the whole tree a few hundred nodes)."""
    budget = [draw(st.integers(1, 300))]

    def leaf() -> common_pb2.Filter:
        field_filter = common_pb2.FieldFilter(
            key=draw(KEYS), operator=draw(OPERATORS), values=draw(st.lists(METADATA_VALUES, max_size=4))
        )
        if draw(st.booleans()):
            field_filter.value.CopyFrom(draw(METADATA_VALUES))
        return common_pb2.Filter(field=field_filter)

    def node(depth: int) -> common_pb2.Filter:
        budget[0] -= 1
        if depth >= max_depth or budget[0] <= 0:
            return leaf()
        kind = draw(st.sampled_from(["leaf", "leaf", "and", "or", "not", "empty"]))
        if kind == "leaf":
            return leaf()
        if kind == "empty":
            return common_pb2.Filter()
        if kind == "not":
            return common_pb2.Filter(not_filter=node(depth + 1))
        width = draw(st.integers(0, max(0, min(max_width, budget[0]))))
        children = common_pb2.FilterList(filters=[node(depth + 1) for _ in range(width)])
        return common_pb2.Filter(**{f"{kind}_filters": children})

    return node(0)


def exists(key: str = "n") -> common_pb2.Filter:
    return common_pb2.Filter(
        field=common_pb2.FieldFilter(key=key, operator=common_pb2.FILTER_OPERATOR_EXISTS)
    )


def chain(depth: int) -> common_pb2.Filter:
    """AND and NOT nodes alternating `depth` levels above one leaf."""
    node = exists()
    for level in range(depth):
        if level % 2:
            node = common_pb2.Filter(not_filter=node)
        else:
            node = common_pb2.Filter(and_filters=common_pb2.FilterList(filters=[node]))
    return node


def wide(width: int) -> common_pb2.Filter:
    leaves = [
        common_pb2.Filter(
            field=common_pb2.FieldFilter(
                key="n",
                operator=common_pb2.FILTER_OPERATOR_GT,
                value=common_pb2.MetadataValue(number_value=i),
            )
        )
        for i in range(width)
    ]
    return common_pb2.Filter(or_filters=common_pb2.FilterList(filters=leaves))


VALID_FILTERS = st.sampled_from(
    [
        chain(1),
        chain(7),
        wide(3),
        wide(60),
        common_pb2.Filter(
            field=common_pb2.FieldFilter(
                key="topic",
                operator=common_pb2.FILTER_OPERATOR_IN,
                values=[
                    common_pb2.MetadataValue(string_value="sea"),
                    common_pb2.MetadataValue(number_value=1),
                ],
            )
        ),
    ]
)
FILTERS = st.one_of(
    filter_trees(),
    VALID_FILTERS,
    st.sampled_from([chain(12), chain(13), chain(40), wide(80), wide(65)]),
)


def with_filter(request: Any, draw: st.DrawFn) -> Any:
    if draw(st.booleans()):
        request.filter.CopyFrom(draw(FILTERS))
    return request


# --- page tokens --------------------------------------------------------------------------------


def forged_memory_token(filter_bytes: bytes, created: str, memory_id: str) -> str:
    """A ListMemories token as the service builds it (base64url JSON bound to the filter)."""
    tag = hashlib.sha256(filter_bytes).hexdigest()[:16]
    return b64url(json.dumps({"c": created, "i": memory_id, "f": tag}).encode())


FORGED_TIMES = st.sampled_from(
    [
        "0001-01-01T00:00:00+14:00",
        "0001-01-01T00:00:00+00:00",
        "9999-12-31T23:59:59-14:00",
        "9999-12-31T23:59:59.999999+00:00",
        "2024-02-30T00:00:00+00:00",
        "2024-01-01T00:00:00",
        "2024-01-01",
        "1970-01-01T00:00:00+00:00",
    ]
)


def page_tokens(known: str) -> st.SearchStrategy[str]:
    """The real token (or none) mostly; else random text, base64url of random bytes, a mutation."""
    mutations = [known[:-1], known + "A", known[::-1], known.upper()] if known else ["x"]
    return mostly(
        st.sampled_from(["", known]),
        st.one_of(
            RANDOM_TEXT,
            st.binary(max_size=80).map(b64url),
            st.binary(max_size=600).map(b64url),
            SMALL_TEXT.map(lambda s: b64url(s.encode())),
            st.sampled_from([*mutations, "=", "====", "AAAA", b64url(b"\x00"), b64url(b"\xff\xfe")]),
            st.integers(-(2**70), 2**70).map(str),
            st.sampled_from(["²", "١٢٣", "0" * 19, "9" * 19, "9223372036854775807", "9223372036854775808"]),
        ),
        70,
    )


# --- documents --------------------------------------------------------------------------------

DOCUMENTS = st.sampled_from(
    [
        b"# Title\n\n## Section\n\nSome text about tides.\n",
        b"<html><head><script>alert(1)</script></head><body><h1>x</h1><p>y</p></body></html>",
        b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n1 0 obj\n<<>>\nendobj\ntrailer\n<<>>\n%%EOF",
        b"\xff\xfe\x00\x00garbage",
        b"\xef\xbb\xbfbom text",
        b"\x00\x00\x00",
        b"",
        b"a" * (MAX_UPLOAD + 1),
        ("\u00e9\u0301" * 5000).encode(),
        b"#" * 10_000,
        b"```\n" * 2000,
        b"<" * 5000,
        b"text with a lone surrogate \xed\xa0\x80 (CESU-8)",
        b"text with a NUL\x00 inside",
        b"# CRLF\r\n\r\ntext\r\nmore\xe2\x80\xa8",
        "line\u2028separated\u2029paragraphs\x85next".encode(),
    ]
)
CONTENT_TYPES = mostly(
    st.sampled_from(["text/plain", "text/markdown", "text/html", "text/plain; charset=utf-8"]),
    st.sampled_from(["application/pdf", "TEXT/HTML", "", "text/html; charset=latin-1"]) | printable(60),
)


# --- raw wire bytes ---------------------------------------------------------------------------


def varint(value: int) -> bytes:
    encoded = b""
    while True:
        low, value = value & 0x7F, value >> 7
        encoded += bytes([low | 0x80 if value else low])
        if not value:
            return encoded


def length_delimited(field_number: int, payload: bytes) -> bytes:
    return varint(field_number << 3 | 2) + varint(len(payload)) + payload


def nested_filter(depth: int) -> bytes:
    """A Filter nested `depth` NOT levels deep, past what protobuf builds (or parses) as objects."""
    node = exists().SerializeToString()
    for _ in range(depth):
        node = length_delimited(4, node)
    return node


# The request field holding a Filter, for the RPCs that take one.
FILTER_FIELD = {"ListMemories": 3, "SearchMemories": 5, "ListDocuments": 5, "SearchKnowledge": 5}


def wire(draw: st.DrawFn, rpc_method: str, message: Any) -> bytes:
    """Bytes on the wire that are not what a protobuf library would send for `message`."""
    encoded = message.SerializeToString()
    kind = draw(st.sampled_from(["random", "truncated", "appended", "unknown field", "nested"]))
    if kind == "truncated" and encoded:
        return encoded[: draw(st.integers(0, len(encoded) - 1))]
    if kind == "appended":
        return encoded + draw(st.binary(min_size=1, max_size=16))
    if kind == "unknown field":
        return encoded + length_delimited(1000, draw(st.binary(max_size=16)))  # valid: ignored
    if kind == "nested" and rpc_method in FILTER_FIELD:
        return encoded + length_delimited(FILTER_FIELD[rpc_method], nested_filter(draw(st.integers(90, 200))))
    return draw(st.binary(max_size=64))


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
    elif shape == "nested":
        depth = draw(st.sampled_from([50, 300, 2000]))
        return b64url(b"[" * depth + b"]" * depth)
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
    tag = hashlib.sha256(filter_bytes).hexdigest()[:16]
    return {
        "c": FORGED_TIMES | st.datetimes().map(lambda d: d.isoformat() + "+00:00"),
        "i": st.uuids().map(str),
        "f": st.just(tag) | st.text(st.sampled_from("0123456789abcdef"), min_size=16, max_size=16),
    }


def _surrogates(text: str) -> str:
    return text.replace(SURROGATE_MARK, "\ud800")


def text_page_tokens() -> st.SearchStrategy[str]:
    """base64url of text, as a "the last ref of the previous page" token is: hostile refs (a real
    lone surrogate among them), random text, bytes that are no UTF-8, a ref past every limit."""
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
    return HostileToken(odd_header, json_bytes(claims, encoding), tuple(changed))


def _nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value
