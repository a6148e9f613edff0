"""The extraction pool: uploads are extracted and chunked in worker processes, and a worker still
busy when its call ends (the deadline, the server's limit, a cancelled call) is killed, not left
to finish (issue 14, finding 7). Real processes throughout; no timing is asserted, only what
happened to the work."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.knowledge.worker_support import SLOW_HTML, extraction_workers, killed
from tokensvc.errors import DeadlineExceeded, InvalidArgument, PayloadTooLarge
from tokensvc.knowledge import ChunkingKind, ChunkingStrategy, ExtractionPool, chunk_document, extract_text
from tokensvc.observability.deadlines import reset_deadline, use_deadline
from tokensvc.observability.metrics import METRICS

GIB = 1024**3
RECURSIVE = ChunkingStrategy(ChunkingKind.RECURSIVE, 64, 8)
PAGE = b"<h1>Tides</h1><p>The tide turns twice a day.</p><h2>Gulls</h2><p>They follow the boats.</p>"


@dataclass(frozen=True)
class Started:
    pool: ExtractionPool
    worker: int  # the process id of its one worker


async def started(limit_seconds: float = 60, memory_bytes: int = 2 * GIB) -> Started:
    """A pool of one worker, started by a first document so its worker is known."""
    others = extraction_workers()  # other tests' pools may be alive in this process
    pool = ExtractionPool(workers=1, limit_seconds=limit_seconds, memory_bytes=memory_bytes)
    await pool.chunks(PAGE, "text/html", RECURSIVE)
    (worker,) = extraction_workers() - others
    return Started(pool, worker)


@pytest.fixture
async def one() -> AsyncIterator[Started]:
    pool = await started()
    yield pool
    await asyncio.to_thread(pool.pool.close)


def outcomes(*names: str) -> float:
    return sum(METRICS.extractions.labels(outcome=name)._value.get() for name in names)


async def test_chunks_are_the_ones_extraction_and_chunking_make_in_process(one: Started) -> None:
    for content, content_type in [(PAGE, "text/html"), (b"# Tides\n\nThey turn.\n", "text/markdown")]:
        expected = chunk_document(extract_text(content, content_type), RECURSIVE)
        assert await one.pool.chunks(content, content_type, RECURSIVE) == expected
    assert one.worker in extraction_workers()  # one worker did all of it


@pytest.mark.parametrize(
    ("content", "content_type", "field", "message"),
    [
        (b"caf\xe9", "text/plain", "content", "is not valid UTF-8 (at byte 3)"),
        (b"<p>  </p>", "text/html", "content", "has no text"),
        (b"text", "text/plain; charset=latin-1", "header.content_type", "charset must be utf-8"),
    ],
)
async def test_a_refusal_in_the_worker_names_its_field_and_keeps_the_worker(
    one: Started, content: bytes, content_type: str, field: str, message: str
) -> None:
    with pytest.raises(InvalidArgument) as refused:
        await one.pool.chunks(content, content_type, RECURSIVE)
    assert refused.value.field == field
    assert refused.value.message.startswith(f"{field}: {message}")
    assert one.worker in extraction_workers()


async def test_the_callers_deadline_kills_the_worker_and_the_pool_goes_on(one: Started) -> None:
    counted = outcomes("deadline")
    token = use_deadline(0.3)
    try:
        with pytest.raises(DeadlineExceeded):
            await one.pool.chunks(SLOW_HTML, "text/html", RECURSIVE)
    finally:
        reset_deadline(token)
    assert await killed(frozenset({one.worker})) == {one.worker}
    assert outcomes("deadline") == counted + 1
    assert await one.pool.chunks(PAGE, "text/html", RECURSIVE)  # a new worker took its place


async def test_the_servers_limit_bounds_a_call_without_a_deadline() -> None:
    one = await started(limit_seconds=0.5)
    try:
        with pytest.raises(PayloadTooLarge) as refused:
            await one.pool.chunks(SLOW_HTML, "text/html", RECURSIVE)
        assert refused.value.field == "content"
        assert "took longer than 0.5 s to extract and chunk" in refused.value.message
        assert await killed(frozenset({one.worker})) == {one.worker}
    finally:
        await asyncio.to_thread(one.pool.close)


async def test_a_cancelled_call_kills_the_worker(one: Started) -> None:
    counted = outcomes("cancelled")
    upload = asyncio.create_task(one.pool.chunks(SLOW_HTML, "text/html", RECURSIVE))
    await asyncio.sleep(0.3)
    upload.cancel()
    with pytest.raises(asyncio.CancelledError):
        await upload
    assert await killed(frozenset({one.worker})) == {one.worker}
    assert outcomes("cancelled") == counted + 1
    assert await one.pool.chunks(PAGE, "text/html", RECURSIVE)


async def test_a_document_that_needs_more_memory_than_the_cap_is_too_large() -> None:
    """SLOW_HTML's tree needs some 250 MB over the 170 MiB a worker starts with."""
    one = await started(memory_bytes=300 * 1024**2)
    try:
        with pytest.raises(PayloadTooLarge) as refused:
            await one.pool.chunks(SLOW_HTML, "text/html", RECURSIVE)
        assert refused.value.field == "content"
        assert "needs more memory to extract" in refused.value.message
        assert await one.pool.chunks(PAGE, "text/html", RECURSIVE)
    finally:
        await asyncio.to_thread(one.pool.close)


async def test_the_kernel_kills_a_worker_before_the_server_when_memory_runs_out(one: Started) -> None:
    assert oom_score_adjustment(one.worker) == 1000
    assert oom_score_adjustment(os.getpid()) < 1000


def oom_score_adjustment(pid: int) -> int:
    return int(Path(f"/proc/{pid}/oom_score_adj").read_text(encoding="ascii"))


async def test_a_worker_that_dies_is_an_invalid_upload_not_an_internal_error(one: Started) -> None:
    """The kernel's OOM killer, or a crash in the parser: the document did it."""
    upload = asyncio.create_task(one.pool.chunks(SLOW_HTML, "text/html", RECURSIVE))
    await asyncio.sleep(0.3)
    os.kill(one.worker, signal.SIGKILL)
    with pytest.raises(PayloadTooLarge) as refused:
        await upload
    assert refused.value.field == "content"
    assert "the worker extracting it died" in refused.value.message
    assert await one.pool.chunks(PAGE, "text/html", RECURSIVE)
