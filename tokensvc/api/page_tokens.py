"""The one page-token codec of every List RPC: an opaque position bound to the listing.

A token is base64url JSON of the position (string values under single-letter keys) and `f`, a
tag of the listing it belongs to: the request's filter and whatever else selects the rows (the
namespace and knowledge base of ListDocuments). It carries no secret and grants nothing (the
tenant predicate and row-level security still decide what is visible), so it only needs to be
well-formed; the tag makes a token reused with another filter or listing an INVALID_ARGUMENT, not
a wrong page. A token is at most 1,024 characters and its JSON is checked for size and nesting
before it is parsed (`tokensvc.untrusted_json`); the positions' own syntax is checked by the
typed decoders below.
"""

from __future__ import annotations

import base64
import hashlib
import json
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime

from tokensvc.errors import InvalidArgument
from tokensvc.memory.paging import PageCursor
from tokensvc.untrusted_json import UntrustedJsonError, parse_base64url

__all__ = [
    "decode_memory_cursor",
    "decode_ref_position",
    "encode_memory_cursor",
    "encode_ref_position",
    "listing_binding",
]

_FIELD = "page_token"
_MAX_TOKEN = 1024
_MAX_REF = 512


def listing_binding(*parts: bytes | str) -> bytes:
    """What a token is bound to: the listing's selecting fields, length-prefixed."""
    out = bytearray()
    for part in parts:
        data = part.encode("utf-8", "surrogatepass") if isinstance(part, str) else part
        out += len(data).to_bytes(4, "big") + data
    return bytes(out)


def _tag(binding: bytes) -> str:
    return hashlib.sha256(binding).hexdigest()[:16]


def _refused(why: str = "is not a token this service issued") -> InvalidArgument:
    return InvalidArgument(_FIELD, why)


def _encode(position: Mapping[str, str], binding: bytes) -> str:
    body = {**position, "f": _tag(binding)}
    return base64.urlsafe_b64encode(json.dumps(body, separators=(",", ":")).encode()).decode().rstrip("=")


def _decode(token: str, binding: bytes, keys: tuple[str, ...]) -> dict[str, str]:
    try:
        body = parse_base64url(token, max_chars=_MAX_TOKEN)
    except UntrustedJsonError:
        raise _refused() from None
    if (
        not isinstance(body, dict)
        or set(body) != {*keys, "f"}
        or not all(isinstance(v, str) for v in body.values())
    ):
        raise _refused()
    if body["f"] != _tag(binding):
        raise _refused("was issued for a different filter or listing")
    try:  # a JSON `\ud800` escape decodes to a lone surrogate, which no database text can hold
        for key in keys:
            body[key].encode("utf-8")
    except UnicodeEncodeError:
        raise _refused() from None
    return {key: body[key] for key in keys}


def encode_memory_cursor(cursor: PageCursor, binding: bytes) -> str:
    return _encode({"c": cursor.created_at.isoformat(), "i": cursor.id}, binding)


def decode_memory_cursor(token: str, binding: bytes) -> PageCursor | None:
    """ListMemories' position: (created_at, id) of the last memory of the previous page."""
    if not token:
        return None
    position = _decode(token, binding, ("c", "i"))
    try:
        created_at = datetime.fromisoformat(position["c"])
        memory_id = str(uuid.UUID(position["i"]))
        if created_at.tzinfo is None:
            raise ValueError("naive timestamp")
        # In UTC, as the database compares it: a forged 0001-01-01T00:00+14:00 has no UTC value.
        created_at = created_at.astimezone(UTC)
    except (ValueError, OverflowError):
        raise _refused() from None
    return PageCursor(created_at, memory_id)


def encode_ref_position(last_ref: str, binding: bytes) -> str:
    return _encode({"r": last_ref}, binding)


def decode_ref_position(token: str, binding: bytes) -> str | None:
    """ListKnowledgeBases' and ListDocuments' position: the last ref of the previous page."""
    if not token:
        return None
    ref = _decode(token, binding, ("r",))["r"]
    if not ref or len(ref) > _MAX_REF or "\x00" in ref:
        raise _refused()
    return ref
