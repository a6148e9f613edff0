"""Extraction and chunking of uploaded documents, in worker processes that can be stopped.

Extracting and chunking a large document is CPU-bound for seconds (about 1.3 s for 4 MB of HTML
on the reference machine, so tens of seconds near the 64 MiB upload limit). In a thread it holds
the GIL against the event loop, and it cannot be stopped: Python has no way to kill a thread, so
the work went on after the caller's deadline. Here it runs in a small pebble process pool:

- when the call ends first (its deadline passed, or the client went away: gRPC cancels the
  handler, and cancelling the future kills the worker running it), the worker is killed and the
  pool starts another;
- a server-side limit (`knowledge_extract_seconds`) bounds a call that set no deadline; the
  caller's remaining deadline, when shorter, is the limit instead;
- the workers fork from multiprocessing's fork server, a process started once with the extraction
  modules preloaded, never from this multi-threaded one (gRPC and the embedder run threads, and
  forking those is unsafe);
- memory is bounded too: BeautifulSoup's tree takes 25 (prose) to 125 (one-word paragraphs)
  bytes per byte of HTML. Each worker's address space is capped (`knowledge_extract_memory_bytes`,
  RLIMIT_AS), so a document that needs more is refused (PAYLOAD_TOO_LARGE) rather than growing the
  pod towards its limit; and each worker asks the kernel to kill it first should memory run out
  anyway (`oom_score_adj` 1000): the worker extracting the document must die, not the server;
- a worker exits when the service process does (a thread in it waits on the service's pidfd), so
  a killed service leaves no extraction running.

The pool starts on the first upload (in a thread: starting the fork server takes a moment), so a
replica that is never sent a document runs no workers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import os
import resource
import select
import threading
import time
from dataclasses import dataclass
from typing import Any

import pebble

from tokensvc.errors import DeadlineExceeded, InvalidArgument, PayloadTooLarge
from tokensvc.knowledge.chunking import Chunk, ChunkingStrategy, chunk_document
from tokensvc.knowledge.formats import (
    FORMAT_MODULES,
    ExtractionLimits,
    Location,
    SourceSpan,
    SpanIndex,
    extract_document,
)
from tokensvc.observability.deadlines import current_deadline
from tokensvc.observability.metrics import METRICS

__all__ = ["Extraction", "ExtractionPool"]

_log = logging.getLogger("tokensvc.knowledge")
_NEEDS_MORE_MEMORY = "needs more memory to extract than knowledge_extract_memory_bytes allows"
# The pool's own module (and with it chunking, bs4 and lxml) and every format's parser: a forked
# worker starts with them loaded, where the server's own process never loads them.
_PRELOADED = ["tokensvc.knowledge.extraction_pool", *FORMAT_MODULES]


@dataclass(frozen=True)
class _Refused:
    """An `InvalidArgument` raised in a worker, sent back as data: the exception itself does not
    survive pickling (its constructor takes two arguments, its `args` hold one)."""

    field: str
    message: str
    too_large: bool = False  # PayloadTooLarge
    error_type: str | None = None  # an unexpected exception's type, for the server's log


def _prepare_worker(memory_bytes: int, service: int) -> None:
    """Worker initializer: cap the address space; be the OOM killer's first choice; and exit when
    the service process `service` does, even mid-document (its parent is the fork server, which
    outlives a killed service while a worker runs, so a parent-death signal would not fire)."""
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = memory_bytes if hard == resource.RLIM_INFINITY else min(memory_bytes, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        with open("/proc/self/oom_score_adj", "w", encoding="ascii") as adjustment:
            adjustment.write("1000")
    except OSError:  # not Linux, or /proc not mounted: the default choice stands
        pass
    threading.Thread(target=_exit_with, args=(service,), name="service-watch", daemon=True).start()


def _exit_with(service: int) -> None:
    try:
        handle = os.pidfd_open(service)  # this very process: immune to the pid's reuse
    except (AttributeError, OSError):  # not Linux 5.3+: look every second
        while _running(service):
            time.sleep(1.0)
    else:
        select.select([handle], [], [])  # readable once the process has exited
    os._exit(1)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def _ready() -> bool:
    return True


@dataclass(frozen=True)
class Extraction:
    """A document's extracted text, its media type (resolved from the bytes when it was sent as
    `application/octet-stream`) and source spans, and its chunks under each strategy asked for,
    in order, each chunk with its location (`locations[i][j]` is that of `chunkings[i][j]`)."""

    text: str
    chunkings: tuple[list[Chunk], ...]
    media_type: str = "text/plain"
    spans: tuple[SourceSpan, ...] = ()
    locations: tuple[tuple[Location, ...], ...] = ()


def _extract_and_chunk(
    content: bytes, content_type: str, strategies: tuple[ChunkingStrategy, ...], limits: ExtractionLimits
) -> Extraction | _Refused:
    """What a worker runs: the document's text, spans and located chunks, or why its content is
    refused."""
    try:
        document = extract_document(content, content_type, limits)
        chunkings = tuple(chunk_document(document.text, strategy) for strategy in strategies)
        where = SpanIndex(document.spans)
        return Extraction(
            document.text,
            chunkings,
            document.media_type,
            document.spans,
            tuple(tuple(where.locate(c.start, c.end) for c in chunks) for chunks in chunkings),
        )
    except InvalidArgument as error:
        message = error.message.removeprefix(f"{error.field}: ")
        return _Refused(error.field or "content", message, too_large=isinstance(error, PayloadTooLarge))
    except MemoryError:  # the address-space cap (the OOM killer kills without a word)
        return _Refused("content", _NEEDS_MORE_MEMORY, too_large=True)
    except Exception as error:  # the parser failed on this document: its fault, not the caller's 500
        return _Refused("content", "could not be extracted", error_type=type(error).__qualname__)


class ExtractionPool:
    """Runs `extract_document` and `chunk_document` for uploads in `workers` processes."""

    def __init__(
        self, workers: int, limit_seconds: float, memory_bytes: int, limits: ExtractionLimits | None = None
    ) -> None:
        self._workers = workers
        self._limit = limit_seconds
        self._memory = memory_bytes
        self._limits = limits or ExtractionLimits()
        self._pool: pebble.ProcessPool | None = None
        self._closed = False
        self._running: set[concurrent.futures.Future[Any]] = set()
        self._lock = threading.Lock()  # close() runs in a thread; so does the first start

    async def chunks(self, content: bytes, content_type: str, strategy: ChunkingStrategy) -> list[Chunk]:
        """The document's chunks (as `extract`, with one strategy)."""
        return (await self.extract(content, content_type, (strategy,))).chunkings[0]

    async def extract(
        self, content: bytes, content_type: str, strategies: tuple[ChunkingStrategy, ...]
    ) -> Extraction:
        """The document's text and its chunks under each of `strategies` (an upload during a
        re-chunking migration asks for two). InvalidArgument for content that cannot be extracted (as
        `extract_document`), PayloadTooLarge when it takes longer than the server's limit or kills its
        worker, DeadlineExceeded when the caller's deadline passes first; a cancelled call stops
        the work too (and so does `close`, which cancels the calls still in flight)."""
        deadline = current_deadline()
        timeout = self._limit if deadline is None else min(self._limit, deadline - time.monotonic())
        by_deadline = timeout < self._limit
        if timeout <= 0:  # pebble reads a timeout of 0 as none at all
            METRICS.extractions.labels(outcome="deadline").inc()
            raise DeadlineExceeded("the call's deadline passed before the document was extracted")
        pool = self._pool if self._pool is not None else await asyncio.to_thread(self._start)
        future = self._schedule(pool, content, content_type, strategies, timeout)
        try:
            # Cancelling this await (gRPC cancelled the call) cancels `future`, and pebble kills
            # the worker that runs it.
            result: Extraction | _Refused = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            METRICS.extractions.labels(outcome="cancelled").inc()
            raise
        except concurrent.futures.TimeoutError:
            if by_deadline:
                METRICS.extractions.labels(outcome="deadline").inc()
                raise DeadlineExceeded(
                    "the call's deadline passed while the document was extracted"
                ) from None
            METRICS.extractions.labels(outcome="time_limit").inc()
            raise PayloadTooLarge(
                "content",
                f"took longer than {self._limit:g} s to extract and chunk; split it into smaller documents",
            ) from None
        except MemoryError:  # the cap, hit in pebble's own code around the task (the arguments)
            METRICS.extractions.labels(outcome="refused").inc()
            raise PayloadTooLarge("content", _NEEDS_MORE_MEMORY) from None
        except pebble.ProcessExpired as error:
            # Killed by the kernel (out of memory) or crashed in the parser: the document did it.
            METRICS.extractions.labels(outcome="worker_died").inc()
            _log.warning("document extraction worker died", extra={"exit_code": error.exitcode})
            raise PayloadTooLarge(
                "content", "could not be extracted: the worker extracting it died; try a smaller document"
            ) from None
        finally:
            self._running.discard(future)
        if isinstance(result, _Refused):
            METRICS.extractions.labels(outcome="refused").inc()
            if result.error_type is not None:
                _log.warning("document extraction failed", extra={"error_type": result.error_type})
            raise (PayloadTooLarge if result.too_large else InvalidArgument)(result.field, result.message)
        METRICS.extractions.labels(outcome="ok").inc()
        return result

    def _schedule(
        self,
        pool: pebble.ProcessPool,
        content: bytes,
        content_type: str,
        strategies: tuple[ChunkingStrategy, ...],
        timeout: float,
    ) -> concurrent.futures.Future[Any]:
        with self._lock:
            if self._closed:
                raise _closed()
            future = pool.schedule(
                _extract_and_chunk, (content, content_type, strategies, self._limits), timeout=timeout
            )
            self._running.add(future)
            return future

    def _start(self) -> pebble.ProcessPool:
        """The pool, started (fork server, preload, workers) and answering: seconds of waiting
        the first upload does in a thread, never on the event loop."""
        with self._lock:
            if self._closed:
                raise _closed()
            if self._pool is None:
                context = multiprocessing.get_context("forkserver")
                context.set_forkserver_preload(_PRELOADED)
                pool = pebble.ProcessPool(
                    max_workers=self._workers,
                    initializer=_prepare_worker,
                    initargs=(self._memory, os.getpid()),
                    context=context,
                )
                pool.schedule(_ready).result()
                self._pool = pool
            return self._pool

    def close(self) -> None:
        """Stop the workers (killing any that still work) and wait for them; blocking. Calls in
        flight are cancelled; later ones are a bug (the server stops serving first)."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
            running, self._running = self._running, set()
        for future in running:
            future.cancel()
        if pool is not None:
            pool.stop()  # type: ignore[no-untyped-call]  # pebble leaves it unannotated
            pool.join()


def _closed() -> RuntimeError:
    return RuntimeError("the extraction pool is closed (the service is stopping)")
