"""Embedders: text to vectors behind one small interface, configured by name.

`hash` is built in (feature hashing, no model, no network); `openai` talks to any
OpenAI-compatible embeddings endpoint. A memory space or knowledge base pins the `EmbedderSpec` of
its first write.
"""

from __future__ import annotations

from tokensvc.embedders.base import Embedder, EmbedderSpec, Vectors, normalize_rows
from tokensvc.embedders.hashing import HASH_MODEL, HashEmbedder
from tokensvc.embedders.openai import OpenAIEmbedder
from tokensvc.embedders.registry import BUILTIN_EMBEDDER, EmbedderRegistry, load_embedders
from tokensvc.embedders.scheduled import ScheduledEmbedder
from tokensvc.embedders.scheduling import Capacity, Demand, FairScheduler, WorkClass, fair_share

__all__ = [
    "BUILTIN_EMBEDDER",
    "HASH_MODEL",
    "Capacity",
    "Demand",
    "Embedder",
    "EmbedderRegistry",
    "EmbedderSpec",
    "FairScheduler",
    "HashEmbedder",
    "OpenAIEmbedder",
    "ScheduledEmbedder",
    "Vectors",
    "WorkClass",
    "fair_share",
    "load_embedders",
    "normalize_rows",
]
