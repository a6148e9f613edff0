"""The embedder the domain holds: a configured embedder whose every call goes through its scheduler.

The registry wraps each configured embedder in one `ScheduledEmbedder` (a proxy, as caching or
metrics would be), so no caller can reach a model around the schedule. Its calls say who waits:
`embed_documents(texts, demand)` with the class and tenant, `embed_query(text, tenant)` in the
query class. See `tokensvc.embedders.scheduling` for the schedule itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tokensvc.embedders.base import Embedder, EmbedderSpec, Vectors
from tokensvc.embedders.scheduling import Capacity, Demand, FairScheduler, WorkClass, capacity_of

__all__ = ["ScheduledEmbedder"]


class ScheduledEmbedder:
    """`inner` behind a `FairScheduler` sized by the embedder's own `capacity`."""

    def __init__(self, inner: Embedder, *, tenant_queue_texts: int) -> None:
        self._inner = inner
        self._scheduler = FairScheduler(
            inner.spec.name, capacity_of(inner), tenant_queue_texts=tenant_queue_texts
        )

    def __repr__(self) -> str:
        return f"ScheduledEmbedder({self._inner!r})"

    @property
    def spec(self) -> EmbedderSpec:
        return self._inner.spec

    @property
    def inner(self) -> Embedder:
        """The configured embedder (to inspect; calls go through `embed_documents`/`embed_query`)."""
        return self._inner

    @property
    def capacity(self) -> Capacity:
        return self._scheduler.capacity

    @property
    def scheduler(self) -> FairScheduler:
        return self._scheduler

    async def embed_documents(self, texts: Sequence[str], demand: Demand) -> Vectors:
        """One row per text, in order (the `Embedder` contract), embedded slice by slice as the
        schedule reaches them."""
        if isinstance(texts, str):
            raise TypeError("embed_documents takes a sequence of texts, not one string")
        # An embedder with its own fast lane (the embedded model's fast thread) runs the short
        # slices the scheduler gives the fast slot there; others take them like any slice.
        fast = getattr(self._inner, "embed_documents_fast", None)
        parts = await self._scheduler.run(demand, texts, self._inner.embed_documents, fast)
        if not parts:
            return np.zeros((0, self.spec.dimension), dtype=np.float32)
        return parts[0] if len(parts) == 1 else np.ascontiguousarray(np.concatenate(parts))

    async def embed_query(self, text: str, tenant: str) -> Vectors:
        """The vector a search uses, in the query class (ahead of every write, on the fast slot
        when it is free)."""

        fast = getattr(self._inner, "embed_query_fast", self._inner.embed_query)

        async def on_shared_slot(texts: list[str]) -> Vectors:
            return await self._inner.embed_query(texts[0])

        async def on_fast_slot(texts: list[str]) -> Vectors:
            return await fast(texts[0])

        (vector,) = await self._scheduler.run(
            Demand(WorkClass.QUERY, tenant), [text], on_shared_slot, on_fast_slot
        )
        return vector

    async def aclose(self) -> None:
        await self._scheduler.aclose()
        await self._inner.aclose()
