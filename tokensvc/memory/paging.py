"""Opaque page tokens for ListMemories: a position (created_at, id) bound to the filter.

The token is base64url JSON; it carries no secret and grants nothing (row-level security and the
bucket predicate still decide what is visible), so it only needs to be well-formed. Binding it to a
hash of the filter makes a token reused with another filter an INVALID_ARGUMENT, not a wrong page.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

from tokensvc.errors import InvalidArgument

__all__ = ["PageCursor", "decode_page_token", "encode_page_token"]

_FIELD = "page_token"
_MAX_TOKEN = 512


@dataclass(frozen=True)
class PageCursor:
    created_at: datetime
    id: str


def _filter_tag(filter_bytes: bytes) -> str:
    return hashlib.sha256(filter_bytes).hexdigest()[:16]


def encode_page_token(cursor: PageCursor, filter_bytes: bytes) -> str:
    body = {"c": cursor.created_at.isoformat(), "i": cursor.id, "f": _filter_tag(filter_bytes)}
    return base64.urlsafe_b64encode(json.dumps(body, separators=(",", ":")).encode()).decode().rstrip("=")


def decode_page_token(token: str, filter_bytes: bytes) -> PageCursor | None:
    if not token:
        return None
    if len(token) > _MAX_TOKEN:
        raise InvalidArgument(_FIELD, "is not a token this service issued")
    try:
        body = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        if not isinstance(body, dict) or not all(isinstance(body.get(key), str) for key in "cif"):
            raise ValueError("not a token body")
        created_at = datetime.fromisoformat(body["c"])
        memory_id = str(uuid.UUID(body["i"]))
        tag = body["f"]
        if created_at.tzinfo is None:
            raise ValueError("naive timestamp")
        # In UTC, as the database compares it: a forged 0001-01-01T00:00+14:00 has no UTC value.
        created_at = created_at.astimezone(UTC)
    except (
        ValueError,
        KeyError,
        TypeError,
        AttributeError,
        OverflowError,
        binascii.Error,
        UnicodeDecodeError,
    ):
        raise InvalidArgument(_FIELD, "is not a token this service issued") from None
    if tag != _filter_tag(filter_bytes):
        raise InvalidArgument(_FIELD, "was issued for a different filter")
    return PageCursor(created_at, memory_id)
