"""Hypothesis strategies for fuzzing tokensvc's requests: values, not calls (rpcs.py draws one
request per RPC, target.py is the live server, hostile.py holds the hostile values).

- scalars, texts, sizes, enum numbers, floats, durations, timestamps and vectors, valid mostly;
- metadata maps and filter trees of any shape;
- page tokens: mutations of real ones, random bytes and text, well-typed forged memory tokens;
- hostile JSON for every token that carries JSON: nested past the decoders' depth bound (up to
  thousands of levels) and past their size bound;
- documents and content types for uploads;
- raw wire bytes: truncated, appended, unknown fields, filters nested past protobuf's limit.
"""

from __future__ import annotations

import hashlib
import json
import math
import string
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from google.protobuf import duration_pb2, timestamp_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz.target import DIMENSION, MAX_UPLOAD
from tests.support import b64url
from tokensvc.api.page_tokens import listing_binding
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


def listing_tag(*parts: bytes | str) -> str:
    """The `f` of a page token of the listing these request fields select (the filter's
    deterministic bytes; for documents the namespace and knowledge base first): public inputs, so
    a forger can compute it too."""
    return hashlib.sha256(listing_binding(*parts)).hexdigest()[:16]


def forged_memory_token(filter_bytes: bytes, created: str, memory_id: str) -> str:
    """A ListMemories token as the service builds it (base64url JSON bound to the filter)."""
    return b64url(json.dumps({"c": created, "i": memory_id, "f": listing_tag(filter_bytes)}).encode())


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


# --- hostile JSON (issue 35) ---------------------------------------------------------------------

# Depths: just past tokensvc's bound (32), past what the parser survives on a deep stack, and past
# its recursion limit at any stack.
NESTING_DEPTHS = [33, 100, 900, 5000]
# Sizes: just past the 1,024-character tokens, past a capability (8 KiB), and huge.
OVERSIZES = [1025, 8193, 70_000]


def nested_json(depth: int, shape: str) -> bytes:
    """JSON nested `depth` levels: arrays, objects, both, unclosed, or as a value of a token-like
    object (`{"c": [[[...]]], "f": "x"}`)."""
    if shape == "objects":
        return b'{"a":' * depth + b"1" + b"}" * depth
    if shape == "mixed":
        return b'[{"a":' * (depth // 2) + b"1" + b"}]" * (depth // 2)
    if shape == "unclosed":
        return b"[" * depth
    if shape == "in-a-value":
        return b'{"c": ' + b"[" * depth + b"]" * depth + b', "i": "x", "f": "x"}'
    return b"[" * depth + b"]" * depth


def oversized_json(size: int, shape: str) -> bytes:
    """Well-formed JSON of about `size` bytes: a token-like list padded with whitespace, or one
    holding a long string."""
    if shape == "padded":
        return b'["default", "agent-a",' + b" " * size + b'"x"]'
    return b'{"r": "' + b"r" * size + b'", "f": "x"}'


DEEP_JSON = st.builds(
    nested_json,
    st.sampled_from(NESTING_DEPTHS),
    st.sampled_from(["arrays", "objects", "mixed", "unclosed", "in-a-value"]),
)
OVERSIZED_JSON = st.builds(oversized_json, st.sampled_from(OVERSIZES), st.sampled_from(["padded", "string"]))
HOSTILE_JSON = DEEP_JSON | OVERSIZED_JSON
# As an opaque token carries JSON: unpadded base64url.
HOSTILE_JSON_TOKENS = HOSTILE_JSON.map(b64url)


def page_tokens(known: str) -> st.SearchStrategy[str]:
    """The real token (or none) mostly; else random text, base64url of random bytes or of hostile
    JSON, a mutation."""
    mutations = [known[:-1], known + "A", known[::-1], known.upper()] if known else ["x"]
    return mostly(
        st.sampled_from(["", known]),
        st.one_of(
            HOSTILE_JSON_TOKENS,
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
