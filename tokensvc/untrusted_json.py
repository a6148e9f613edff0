"""JSON from outside the process (opaque tokens, capability segments, database announcements),
parsed only once it is known to be small and shallow.

Python's parser recurses once per nesting level, so a few kilobytes of `[` raise RecursionError,
and where that starts depends on how deep the caller's stack already is. Size and depth are
therefore checked first, in one linear pass that never recurses: a document that fails either is
refused without being parsed. Every refusal is `UntrustedJsonError` (a ValueError) with a fixed
message that quotes nothing of the input; callers turn it into their own domain error.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable
from typing import Any, Final

__all__ = ["MAX_DEPTH", "UntrustedJsonError", "parse", "parse_base64url"]

# Deeper than any document tokensvc issues or accepts (page and resume tokens: 1; capabilities: 2),
# and far below the parser's recursion limit at any stack depth.
MAX_DEPTH: Final = 32
_OPENERS: Final = frozenset("[{")
_CLOSERS: Final = frozenset("]}")


class UntrustedJsonError(ValueError):
    """The document is too large, nested too deeply, not UTF-8 or not JSON."""


def parse(
    document: str | bytes,
    *,
    max_bytes: int,
    max_depth: int = MAX_DEPTH,
    object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
) -> Any:
    """The JSON value of `document` (bytes must be UTF-8: no BOM, no UTF-16), if it is at most
    `max_bytes` long (characters, for text) and nests at most `max_depth` arrays and objects.
    Errors of `object_pairs_hook` that are ValueErrors are refused the same way."""
    if len(document) > max_bytes:
        raise UntrustedJsonError("too large")
    if isinstance(document, bytes):
        try:
            document = document.decode("utf-8")
        except UnicodeDecodeError:
            raise UntrustedJsonError("not UTF-8") from None
    if _deeper_than(document, max_depth):
        raise UntrustedJsonError("nested too deeply")
    try:
        return json.loads(document, object_pairs_hook=object_pairs_hook)
    except (ValueError, RecursionError):  # RecursionError: only if a caller's stack is near the limit
        raise UntrustedJsonError("not JSON") from None


def parse_base64url(token: str, *, max_chars: int, max_depth: int = MAX_DEPTH) -> Any:
    """`parse` of the unpadded base64url text `token`, if it is at most `max_chars` long."""
    if len(token) > max_chars:
        raise UntrustedJsonError("too large")
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
    except (ValueError, binascii.Error):
        raise UntrustedJsonError("not base64url") from None
    return parse(raw, max_bytes=max_chars, max_depth=max_depth)


def _deeper_than(text: str, limit: int) -> bool:
    """Whether `text` opens more than `limit` arrays or objects at once (brackets inside strings
    are text). Unbalanced input is the parser's to refuse."""
    if sum(text.count(c) for c in _OPENERS) <= limit:
        return False  # the common case, at C speed: not enough brackets to be too deep
    depth = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in _OPENERS:
            depth += 1
            if depth > limit:
                return True
        elif char in _CLOSERS:
            depth -= 1
    return False
