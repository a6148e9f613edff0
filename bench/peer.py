"""The peer: LangGraph's `AsyncPostgresStore` (langgraph-checkpoint-postgres) on the same PostgreSQL.

It gets its own database on the same server (its migrations create tables `store` and
`store_vectors` in the default schema), a psycopg pool of the same size as tokensvc's asyncpg pool,
and its documented index configuration: `dims=384`, the `text` field embedded, HNSW (pgvector's
defaults, m=16 and ef_construction=64, the same as tokensvc's index) with cosine distance (on unit
vectors the same ranking as tokensvc's inner product). Its `embed` function returns the dataset's
precomputed vectors: for a put, the vector of the item's text; for a search, the vector registered
for the query string `q:<n>`. So both systems index and search exactly the same vectors.

Each tokensvc bucket (one end user) is the namespace `("memories", "<user>")`; a search is
`asearch(("memories", user), query=..., filter=..., limit=10)`: per-user namespaced search, which
is what tokensvc's bucket is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from langgraph.store.base import PutOp
from langgraph.store.postgres import AsyncPostgresStore
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from bench.dataset import DIM, FILTERS, Dataset, content_of, metadata_of

__all__ = ["PeerStore", "peer_filter"]


def peer_filter(name: str) -> dict[str, Any] | None:
    spec = FILTERS[name]
    return None if spec is None else {spec[0]: spec[1]}


class PeerStore:
    """An AsyncPostgresStore whose embedding function looks vectors up instead of computing them."""

    def __init__(self, conninfo: str, pool_size: int):
        self._conninfo = conninfo
        self._pool_size = pool_size
        self._vectors: dict[str, list[float]] = {}
        self.pool: AsyncConnectionPool | None = None
        self.store: AsyncPostgresStore | None = None

    async def _embed(self, texts: Sequence[str]) -> list[list[float]]:
        return [self._vectors[text] for text in texts]

    def register(self, text: str, vector: np.ndarray) -> None:
        self._vectors[text] = vector.astype(float).tolist()

    def forget(self) -> None:
        self._vectors.clear()

    async def open(self) -> AsyncPostgresStore:
        # Exactly what AsyncPostgresStore.from_conn_string(pool_config=...) builds, kept open.
        self.pool = AsyncConnectionPool(
            self._conninfo,
            min_size=self._pool_size,
            max_size=self._pool_size,
            kwargs={"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row},
            open=False,
        )
        await self.pool.open(wait=True)
        self.store = AsyncPostgresStore(
            self.pool,  # type: ignore[arg-type]
            index={"dims": DIM, "embed": self._embed, "fields": ["text"]},
        )
        await self.store.setup()
        return self.store

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()

    async def put_bucket_batch(self, data: Dataset, rows: Sequence[tuple[int, int]]) -> None:
        """One `abatch` of puts: (bucket, row index) pairs, each item's vector registered first."""
        assert self.store is not None
        ops = []
        for b, i in rows:
            j = i - int(data.offsets[b])
            text = content_of(b, j)
            self.register(text, data.vectors[i])
            ops.append(
                PutOp(
                    namespace=("memories", f"user-{b:04d}"),
                    key=data.ids[i],
                    value={"text": text, **metadata_of(j)},
                    index=["text"],
                )
            )
        await self.store.abatch(ops)
        for b, i in rows:
            self._vectors.pop(content_of(b, i - int(data.offsets[b])), None)

    async def search(self, user: str, query: str, filter_name: str, k: int) -> list[str]:
        assert self.store is not None
        items = await self.store.asearch(
            ("memories", user), query=query, filter=peer_filter(filter_name), limit=k
        )
        return [item.key for item in items]
