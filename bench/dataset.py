"""The deterministic synthetic dataset every benchmark measures on (seeded numpy; no files).

Memories are clustered 384-d unit vectors with short text and small metadata, spread over buckets
(one per end user of one agent) whose sizes are skewed on purpose: a few buckets of 10k+ rows, a
few dozen of 1k-10k, many of 100-1k and most under 100 — the shape long-term memory has when a few
power users talk to an agent every day and most users once.

Row `i` of `vectors` belongs to bucket `b` when `offsets[b] <= i < offsets[b + 1]`; its bucket-local
index `j = i - offsets[b]` determines its text and metadata, so nothing but the vectors and ids is
stored. Queries are drawn from the same mixture as the bucket they target, with a metadata filter
(none, `tag` ~10 % of the rows, or `rare` ~1 %), and come with the exact top-k from numpy.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "CLASSES",
    "DIM",
    "FILTERS",
    "SCALES",
    "BucketClass",
    "Dataset",
    "K",
    "Query",
    "Shape",
    "class_of",
    "clustered",
    "content_of",
    "exact_top_k",
    "make_dataset",
    "make_queries",
    "metadata_of",
    "sha256_of",
]

DIM = 384
K = 10
GLOBAL_CENTERS = 256
NOISE = 0.9  # norm of the per-row noise around a cluster centre (cosine to the centre ~0.74)

# Metadata filters a query may carry: name -> (metadata key, value), None for no filter.
FILTERS: dict[str, tuple[str, Any] | None] = {"none": None, "tag": ("tag", "t3"), "rare": ("rare", True)}
FILTER_MIX = (("none", 0.6), ("tag", 0.25), ("rare", 0.15))


@dataclass(frozen=True)
class BucketClass:
    name: str
    low: int  # smallest size in the class
    high: int  # largest size in the class


CLASSES: tuple[BucketClass, ...] = (
    BucketClass("<100", 1, 99),
    BucketClass("100-1k", 100, 999),
    BucketClass("1k-10k", 1000, 9999),
    BucketClass("10k+", 10_000, 10**9),
)


@dataclass(frozen=True)
class Shape:
    """Bucket sizes per class: `count` buckets from `low` to `high`, skewed low by `skew`."""

    low: int
    high: int
    count: int
    skew: float

    def sizes(self) -> list[int]:
        quantiles = (np.arange(self.count) + 0.5) / self.count
        return [int(s) for s in np.floor(self.low * (self.high / self.low) ** (quantiles**self.skew))]


# rows -> shapes (one per class, smallest first). Full: 100,000 rows over 1,000 buckets.
SCALES: dict[str, tuple[int, tuple[Shape, ...]]] = {
    "full": (
        100_000,
        (
            Shape(1, 99, 880, 2.7),
            Shape(100, 999, 105, 3.3),
            Shape(1000, 8000, 12, 1.8),
            Shape(10_000, 14_500, 3, 1.0),
        ),
    ),
    # The full shape with ten times the buckets of every class (issue 15's cost growth).
    "1m": (
        1_000_000,
        (
            Shape(1, 99, 8800, 2.7),
            Shape(100, 999, 1050, 3.3),
            Shape(1000, 8000, 120, 1.8),
            Shape(10_000, 14_500, 30, 1.0),
        ),
    ),
    "quick": (
        26_000,
        (
            Shape(1, 99, 178, 2.7),
            Shape(100, 999, 18, 3.3),
            Shape(1200, 7000, 3, 1.0),
            Shape(11_000, 11_000, 1, 1.0),
        ),
    ),
}


def class_of(size: int) -> str:
    for bucket_class in CLASSES:
        if bucket_class.low <= size <= bucket_class.high:
            return bucket_class.name
    raise ValueError(f"no class for a bucket of {size} rows")


def content_of(bucket: int, j: int) -> str:
    return f"note {j} of user {bucket}: the deploy window, the on-call rota and topic {(bucket * 7 + j) % 97}"


def metadata_of(j: int) -> dict[str, Any]:
    return {"n": j, "tag": f"t{j % 10}", "rare": j % 100 == 0}


def sha256_of(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()


def clustered(rng: np.random.Generator, centers: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Unit vectors around `centers[labels]` (float32)."""
    noise = rng.standard_normal((len(labels), centers.shape[1]), dtype=np.float32)
    points = centers[labels] + noise * np.float32(NOISE / np.sqrt(centers.shape[1]))
    points /= np.linalg.norm(points, axis=1, keepdims=True)
    return points.astype(np.float32, copy=False)


@dataclass(frozen=True)
class Dataset:
    seed: int
    sizes: np.ndarray  # rows per bucket (int64), bucket b is user "user-<b>"
    offsets: np.ndarray  # len(sizes) + 1
    vectors: np.ndarray  # (rows, DIM) float32, unit length, grouped by bucket
    ids: list[str]  # memory ids (uuid text), row-aligned with `vectors`
    centers: np.ndarray  # (GLOBAL_CENTERS, DIM)
    topics: list[np.ndarray]  # per bucket: the global centres its rows are drawn around

    @property
    def rows(self) -> int:
        return int(self.offsets[-1])

    def bucket_rows(self, b: int) -> range:
        return range(int(self.offsets[b]), int(self.offsets[b + 1]))

    def class_of_bucket(self, b: int) -> str:
        return class_of(int(self.sizes[b]))

    def buckets_of_class(self, name: str) -> list[int]:
        return [b for b in range(len(self.sizes)) if self.class_of_bucket(b) == name]


def make_dataset(scale: str, *, seed: int) -> Dataset:
    """The `full` or `quick` dataset: bucket sizes are fixed by SCALES, vectors and ids by `seed`."""
    rows, shapes = SCALES[scale]
    rng = np.random.default_rng(seed)
    sizes = [size for shape in shapes for size in shape.sizes()]
    # The largest bucket absorbs the rounding, so the total is exactly `rows`.
    largest = int(np.argmax(sizes))
    sizes[largest] += rows - sum(sizes)
    order = rng.permutation(len(sizes))  # bucket numbers do not reveal their size
    size_array = np.asarray(sizes, dtype=np.int64)[order]
    offsets = np.concatenate([[0], np.cumsum(size_array)])

    centers = rng.standard_normal((GLOBAL_CENTERS, DIM)).astype(np.float32)
    centers /= np.linalg.norm(centers, axis=1, keepdims=True)
    topics: list[np.ndarray] = []
    labels = np.empty(rows, dtype=np.int64)
    for b, size in enumerate(size_array):
        mine = rng.choice(GLOBAL_CENTERS, size=1 + int(np.log2(max(1, size))), replace=False)
        topics.append(mine)
        labels[offsets[b] : offsets[b + 1]] = mine[rng.integers(0, len(mine), int(size))]
    vectors = np.empty((rows, DIM), dtype=np.float32)
    for start in range(0, rows, 20_000):
        stop = min(rows, start + 20_000)
        vectors[start:stop] = clustered(rng, centers, labels[start:stop])
    ids = [str(uuid.UUID(bytes=rng.bytes(16), version=4)) for _ in range(rows)]
    return Dataset(seed, size_array, offsets, vectors, ids, centers, topics)


@dataclass(frozen=True)
class Query:
    bucket: int
    filter: str  # a FILTERS key
    vector: np.ndarray  # (DIM,) float32, unit length
    truth: tuple[str, ...]  # exact top-k ids (matching rows only), best first
    matching: int  # rows of the bucket matching the filter


def _matches(filter_name: str, j: np.ndarray) -> np.ndarray:
    if filter_name == "tag":
        return j % 10 == 3
    if filter_name == "rare":
        return j % 100 == 0
    return np.ones(len(j), dtype=bool)


def exact_top_k(
    data: Dataset, b: int, vectors: np.ndarray, filter_names: Sequence[str], k: int = K
) -> list[tuple[tuple[str, ...], int]]:
    """Per query: the exact top-k ids of bucket `b` among rows matching its filter, and how many match."""
    rows = data.bucket_rows(b)
    local = np.arange(len(rows))
    scores = data.vectors[rows.start : rows.stop].astype(np.float64) @ vectors.astype(np.float64).T
    out = []
    for q, filter_name in enumerate(filter_names):
        keep = _matches(filter_name, local)
        candidates = local[keep]
        best = candidates[np.argsort(-scores[keep, q], kind="stable")[:k]]
        out.append((tuple(data.ids[rows.start + int(j)] for j in best), int(keep.sum())))
    return out


def make_queries(data: Dataset, buckets: Sequence[int], count: int, seed: int) -> list[Query]:
    """`count` queries spread round-robin over `buckets`, each drawn near one of its bucket's topics."""
    rng = np.random.default_rng(seed)
    names = [name for name, _ in FILTER_MIX]
    weights = np.asarray([weight for _, weight in FILTER_MIX])
    targets = [int(buckets[q % len(buckets)]) for q in range(count)]
    topics = np.asarray([data.topics[b][rng.integers(0, len(data.topics[b]))] for b in targets])
    vectors = clustered(rng, data.centers, topics)
    filters = [str(name) for name in rng.choice(names, size=count, p=weights)]
    truths: dict[int, tuple[tuple[str, ...], int]] = {}
    for b in sorted(set(targets)):
        mine = [q for q in range(count) if targets[q] == b]
        for q, truth in zip(
            mine, exact_top_k(data, b, vectors[mine], [filters[q] for q in mine]), strict=True
        ):
            truths[q] = truth
    return [Query(targets[q], filters[q], vectors[q], *truths[q]) for q in range(count)]
