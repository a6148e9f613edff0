"""A retrieval engine that notes every search it runs: for tests that a service searches through it."""

from __future__ import annotations

from typing import Any, TypeVar

from tokensvc.retrieval import Fetch, Ranked, Retrieval, RetrievalEngine

__all__ = ["RecordingEngine"]

T = TypeVar("T")


class RecordingEngine(RetrievalEngine):
    """The engine as it is, noting each search's `Retrieval` and the results it returned."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.searches: list[tuple[Retrieval, list[Ranked[Any]]]] = []

    async def search(self, retrieval: Retrieval, fetch: Fetch[T]) -> list[Ranked[T]]:
        results = await super().search(retrieval, fetch)
        self.searches.append((retrieval, list(results)))
        return results
