"""MemoryService request shapes checked at the edge, and domain -> proto encoding.

Every INVALID_ARGUMENT names the field the way a client wrote it (`items[3].content`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from google.protobuf import duration_pb2

from tokensvc.api.convert import decode_search_mode, decode_uuid, set_timestamp
from tokensvc.api.filter_codec import filter_from_proto
from tokensvc.api.metadata_codec import metadata_from_proto, set_metadata
from tokensvc.errors import InvalidArgument, PayloadTooLarge
from tokensvc.memory import Filter
from tokensvc.memory.models import MemoryRecord
from tokensvc.memory.service import RememberItem, SearchHit, SearchQuery
from tokensvc.v1 import common_pb2, memory_pb2

__all__ = [
    "MAX_CONTENT_BYTES",
    "MAX_ITEMS",
    "decode_filter",
    "decode_ids",
    "decode_page_size",
    "decode_remember",
    "decode_remove_keys",
    "decode_search",
    "decode_ttl",
    "encode_hits",
    "encode_memory",
]

MAX_ITEMS = 256
MAX_CONTENT_BYTES = 32 * 1024
MAX_QUERY_BYTES = 32 * 1024
MAX_TTL_SECONDS = 3650 * 24 * 3600
MAX_IDS = 256
DEFAULT_TOP_K = 10
MAX_TOP_K = 100
DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 500


def decode_ttl(value: duration_pb2.Duration, field: str) -> int:
    if value.nanos:
        raise InvalidArgument(field, "must be a whole number of seconds")
    if not 1 <= value.seconds <= MAX_TTL_SECONDS:
        raise InvalidArgument(field, "must be between 1 second and 3650 days")
    return int(value.seconds)


def decode_content(value: str, field: str) -> str:
    if not value.strip():
        raise InvalidArgument(field, "must not be empty")
    if len(value.encode("utf-8", "surrogatepass")) > MAX_CONTENT_BYTES:
        raise PayloadTooLarge(field, f"must be at most {MAX_CONTENT_BYTES} bytes of UTF-8")
    if "\x00" in value:
        # PostgreSQL text cannot hold U+0000: refuse it here rather than fail in the database.
        raise InvalidArgument(field, "must not contain U+0000 (NUL)")
    return value


def _idempotency_key(value: str, field: str) -> str | None:
    if not value:
        return None
    if len(value) > 128 or not all(" " < ch < "\x7f" for ch in value):
        raise InvalidArgument(field, "must be 1..128 printable ASCII characters")
    return value


def decode_remember(request: memory_pb2.RememberRequest) -> list[RememberItem]:
    if not 1 <= len(request.items) <= MAX_ITEMS:
        raise InvalidArgument("items", f"must hold 1..{MAX_ITEMS} items")
    return [
        RememberItem(
            content=decode_content(item.content, f"items[{i}].content"),
            metadata=metadata_from_proto(item.metadata, f"items[{i}].metadata"),
            idempotency_key=_idempotency_key(item.idempotency_key, f"items[{i}].idempotency_key"),
            ttl_seconds=decode_ttl(item.ttl, f"items[{i}].ttl") if item.HasField("ttl") else None,
        )
        for i, item in enumerate(request.items)
    ]


def decode_filter(message: common_pb2.Filter, present: bool) -> Filter | None:
    return filter_from_proto(message, "filter") if present else None


def decode_query_vector(raw: bytes) -> np.ndarray:
    if not raw or len(raw) % 4:
        raise InvalidArgument("query_vector", "must be packed little-endian float32 values")
    vector = np.frombuffer(raw, dtype="<f4").astype(np.float32)
    if not np.isfinite(vector).all():
        raise InvalidArgument("query_vector", "must not contain NaN or infinity")
    if not vector.any():
        raise InvalidArgument("query_vector", "must not be all zeros")
    return vector


def decode_search(request: memory_pb2.SearchMemoriesRequest) -> SearchQuery:
    which = request.WhichOneof("query")
    if which is None:
        raise InvalidArgument("query", "set query_text or query_vector")
    text = vector = None
    if which == "query_text":
        if not request.query_text.strip():
            raise InvalidArgument("query_text", "must not be empty")
        if len(request.query_text.encode("utf-8", "surrogatepass")) > MAX_QUERY_BYTES:
            raise PayloadTooLarge("query_text", f"must be at most {MAX_QUERY_BYTES} bytes")
        if "\x00" in request.query_text:
            raise InvalidArgument("query_text", "must not contain U+0000 (NUL)")
        text = request.query_text
    else:
        vector = decode_query_vector(request.query_vector)
    top_k = request.top_k or DEFAULT_TOP_K
    if not 1 <= top_k <= MAX_TOP_K:
        raise InvalidArgument("top_k", f"must be between 1 and {MAX_TOP_K}")
    min_score = request.min_score if request.HasField("min_score") else None
    if min_score is not None and not math.isfinite(min_score):
        raise InvalidArgument("min_score", "must be a finite number")
    mode = decode_search_mode(request.mode, has_text=text is not None)
    return SearchQuery(
        text=text,
        vector=vector,
        top_k=top_k,
        min_score=min_score,
        filter=decode_filter(request.filter, request.HasField("filter")),
        mode=mode,
    )


def decode_id(value: str, field: str) -> str:
    return decode_uuid(value, field, "a memory id")


def decode_ids(values: Sequence[str]) -> list[str]:
    if not 1 <= len(values) <= MAX_IDS:
        raise InvalidArgument("ids", f"must hold 1..{MAX_IDS} ids")
    return [decode_id(value, f"ids[{i}]") for i, value in enumerate(values)]


def decode_remove_keys(request: memory_pb2.UpdateMemoryRequest) -> list[str]:
    """`remove_metadata_keys`, refused when it contradicts `replace_metadata` or `metadata`."""
    keys = list(request.remove_metadata_keys)
    if keys and request.replace_metadata:
        raise InvalidArgument("remove_metadata_keys", "must be empty when replace_metadata is true")
    for index, key in enumerate(keys):
        if key in request.metadata:
            raise InvalidArgument(f"remove_metadata_keys[{index}]", "must not also be set in metadata")
    return keys


def decode_page_size(value: int) -> int:
    if value < 0:
        raise InvalidArgument("page_size", "must not be negative")
    return min(value or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)


def fill_memory(message: memory_pb2.Memory, record: MemoryRecord) -> None:
    """Write `record` into `message` field by field: a search answer carries up to 100 memories,
    and building each as its own message to copy in costs about twice as much."""
    message.id = record.id
    message.content = record.content
    set_timestamp(message.created_at, record.created_at)
    set_timestamp(message.updated_at, record.updated_at)
    message.embedder = record.embedder
    set_metadata(message.metadata, record.metadata)
    if record.expires_at is not None:
        set_timestamp(message.expires_at, record.expires_at)


def encode_memory(record: MemoryRecord) -> memory_pb2.Memory:
    message = memory_pb2.Memory()
    fill_memory(message, record)
    return message


def encode_hits(hits: Sequence[SearchHit]) -> memory_pb2.SearchMemoriesResponse:
    response = memory_pb2.SearchMemoriesResponse()
    for hit in hits:
        result = response.results.add(score=hit.score, vector_rank=hit.vector_rank, text_rank=hit.text_rank)
        fill_memory(result.memory, hit.item)
    return response
