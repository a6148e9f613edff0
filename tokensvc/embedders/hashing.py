"""The built-in `hash` embedder: deterministic feature hashing of words and word pairs.

No model, no network, numpy only: the dev default and the test default. It finds texts that share
words (not meanings), which is enough to exercise every code path of memory and knowledge search.

Algorithm `hash-v1` (any change to it must bump `MODEL`, so spaces pinned to the old one notice):

1. NFKC-normalise and casefold the text; tokens are the Unicode `\\w+` runs.
2. Features are the unigrams and the space-joined bigrams of adjacent tokens.
3. Each feature's weight is `1 + ln(count)` (sublinear tf).
4. A feature lands in slot `(h >> 1) % dimension` with sign `+1` if `h & 1` else `-1`, where `h` is
   the little-endian 64-bit BLAKE2b digest of its UTF-8 bytes (personalised `tokensvc-hash-v1`).
   A stable hash, never Python's `hash()`, which is salted per process.
5. The vector is L2-normalised. A text with no tokens (empty, only punctuation), or whose features
   cancel out exactly, maps to the unit vector of a reserved feature that no token can produce, so
   every text gets a finite unit vector and never NaN.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import math
import re
import unicodedata
from collections import Counter
from collections.abc import Sequence
from itertools import pairwise

import numpy as np

from tokensvc.embedders.base import EmbedderSpec, Vectors, normalize_rows
from tokensvc.embedders.scheduling import Capacity

__all__ = ["HASH_MODEL", "HashEmbedder"]

HASH_MODEL = "hash-v1"
DEFAULT_HASH_DIMENSION = 384
_CAPACITY = Capacity(slots=4, slice_texts=256)

_TOKEN = re.compile(r"\w+")
_PERSON = b"tokensvc-hash-v1"  # BLAKE2b personalisation: these digests mean nothing elsewhere.
# \w+ never yields a NUL, so no real text can produce this feature.
_RESERVED_FEATURE = "\x00no-tokens"
# Above this many characters a batch is hashed in a worker thread so the event loop stays free.
_THREAD_THRESHOLD_CHARS = 32 * 1024


@functools.lru_cache(maxsize=1 << 16)
def _slot(feature: str, dimension: int) -> tuple[int, float]:
    digest = hashlib.blake2b(feature.encode("utf-8"), digest_size=8, person=_PERSON).digest()
    value = int.from_bytes(digest, "little")
    return (value >> 1) % dimension, (1.0 if value & 1 else -1.0)


def _features(text: str) -> Counter[str]:
    tokens = _TOKEN.findall(unicodedata.normalize("NFKC", text).casefold())
    counts = Counter(tokens)
    counts.update(f"{left} {right}" for left, right in pairwise(tokens))
    return counts


class HashEmbedder:
    """Feature-hashing embedder; `spec.model` is `hash-v1`, vectors are always unit length."""

    def __init__(self, name: str = "hash", dimension: int = DEFAULT_HASH_DIMENSION) -> None:
        self._spec = EmbedderSpec(name=name, model=HASH_MODEL, dimension=dimension, normalized=True)
        index, sign = _slot(_RESERVED_FEATURE, dimension)
        reserved = np.zeros(dimension, dtype=np.float64)
        reserved[index] = sign
        self._reserved = reserved

    def __repr__(self) -> str:
        return f"HashEmbedder(name={self._spec.name!r}, dimension={self._spec.dimension})"

    @property
    def spec(self) -> EmbedderSpec:
        return self._spec

    @property
    def capacity(self) -> Capacity:
        """Hashing is quick and runs on the event loop: slots only bound what is in flight."""
        return _CAPACITY

    def vectorize(self, texts: Sequence[str]) -> Vectors:
        """The synchronous core: one unit row per text."""
        dimension = self._spec.dimension
        rows: list[int] = []
        cols: list[int] = []
        weights: list[float] = []
        for row, text in enumerate(texts):
            for feature, count in _features(text).items():
                col, sign = _slot(feature, dimension)
                rows.append(row)
                cols.append(col)
                weights.append(sign * (1.0 + math.log(count)))
        matrix = np.zeros((len(texts), dimension), dtype=np.float64)
        # add.at accumulates repeated (row, col) pairs, i.e. hash collisions, instead of overwriting.
        np.add.at(matrix, (np.asarray(rows, dtype=np.intp), np.asarray(cols, dtype=np.intp)), weights)
        empty = ~matrix.any(axis=1)
        matrix[empty] = self._reserved
        return normalize_rows(matrix)

    async def embed_documents(self, texts: Sequence[str]) -> Vectors:
        if sum(len(text) for text in texts) > _THREAD_THRESHOLD_CHARS:
            return await asyncio.to_thread(self.vectorize, list(texts))
        return self.vectorize(texts)

    async def embed_query(self, text: str) -> Vectors:
        row: Vectors = (await self.embed_documents([text]))[0]
        return row

    async def aclose(self) -> None:
        return None
