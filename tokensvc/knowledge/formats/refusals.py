"""How the binary and structured formats refuse a document: one message shape for each cause.

- a parser's own exception (the file is damaged, truncated, or not of its type) becomes
  `InvalidArgument("content", "is not a valid <FORMAT> file: <short reason>")`: never a generic
  error, whichever exception the library raises;
- a bound of `ExtractionLimits` passed becomes `PayloadTooLarge("content", ...)` saying the limit.

`MemoryError` passes through untouched: the extraction worker's memory cap maps it to
PAYLOAD_TOO_LARGE itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from tokensvc.errors import InvalidArgument, PayloadTooLarge, TokensvcError

__all__ = ["not_valid", "over_limit", "unreadable_as"]

_REASON_CHARS = 160


def not_valid(kind: str, reason: str) -> InvalidArgument:
    """The content is not a valid `kind` file (`kind`: PDF, DOCX, JSON...), for `reason`."""
    return InvalidArgument("content", f"is not a valid {kind} file: {reason}")


def over_limit(count: int | str, what: str, limit: int | float, why: str = "") -> PayloadTooLarge:
    """The content has `count` `what` (pages, rows...), more than the limit of `limit`."""
    message = f"has {count} {what}, more than the limit of {limit:,}"
    return PayloadTooLarge("content", message + (f" ({why})" if why else ""))


@contextmanager
def unreadable_as(kind: str) -> Iterator[None]:
    """Turn any exception a parser raises inside the block into `not_valid(kind, ...)`."""
    try:
        yield
    except (TokensvcError, MemoryError):
        raise
    except Exception as error:
        raise not_valid(kind, _short(error)) from None


def _short(error: Exception) -> str:
    detail = " ".join(str(error).split())
    if len(detail) > _REASON_CHARS:
        detail = detail[: _REASON_CHARS - 1] + "…"
    name = type(error).__name__
    return f"{name}: {detail}" if detail else name
