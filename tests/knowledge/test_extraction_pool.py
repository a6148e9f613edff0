"""The extraction pool: uploads are extracted and chunked in worker processes, and a worker still
busy when its call ends (the deadline, the server's limit, a cancelled call) is killed, not left
to finish (issue 14, finding 7). Real processes throughout; no timing is asserted, only what
happened to the work."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from tests.knowledge.worker_support import SLOW_HTML, busy, extraction_workers, killed
from tokensvc.errors import DeadlineExceeded, InvalidArgument, PayloadTooLarge
from tokensvc.knowledge import (
    ChunkingKind,
    ChunkingStrategy,
    ExtractionPool,
    chunk_document,
    extract_text,
    extraction_pool,
)
from tokensvc.knowledge.formats import ExtractionLimits
from tokensvc.observability.deadlines import reset_deadline, use_deadline

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
    return sum(
        REGISTRY.get_sample_value("tokensvc_document_extractions_total", {"outcome": name}) or 0.0
        for name in names
    )


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
    await busy(one.worker)
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
    await busy(one.worker)
    os.kill(one.worker, signal.SIGKILL)
    with pytest.raises(PayloadTooLarge) as refused:
        await upload
    assert refused.value.field == "content"
    assert "the worker extracting it died" in refused.value.message
    assert await one.pool.chunks(PAGE, "text/html", RECURSIVE)


async def test_a_deadline_already_passed_schedules_nothing(one: Started) -> None:
    """pebble reads a timeout of 0 as no timeout at all: the call must not get an unbounded run."""
    token = use_deadline(-1.0)
    try:
        with pytest.raises(DeadlineExceeded):
            await one.pool.chunks(SLOW_HTML, "text/html", RECURSIVE)
    finally:
        reset_deadline(token)
    assert one.worker in extraction_workers()  # nothing was sent to it, nothing killed


async def test_closing_the_pool_cancels_a_call_in_flight_and_stops_its_worker() -> None:
    one = await started()
    upload = asyncio.create_task(one.pool.chunks(SLOW_HTML, "text/html", RECURSIVE))
    await busy(one.worker)
    await asyncio.to_thread(one.pool.close)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(upload, timeout=20)
    assert await killed(frozenset({one.worker})) == {one.worker}
    with pytest.raises(RuntimeError, match="closed"):
        await one.pool.chunks(PAGE, "text/html", RECURSIVE)


def test_an_unexpected_parser_failure_is_a_refused_document_not_an_internal_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the worker function answers when the parser raises something of its own."""

    def broken(content: bytes, content_type: str, limits: ExtractionLimits) -> str:
        raise RuntimeError("the parser gave up on this document")

    monkeypatch.setattr(extraction_pool, "extract_document", broken)
    refused = extraction_pool._extract_and_chunk(PAGE, "text/html", RECURSIVE, ExtractionLimits())
    assert isinstance(refused, extraction_pool._Refused)
    assert (refused.field, refused.message, refused.error_type) == (
        "content",
        "could not be extracted",
        "RuntimeError",
    )


def test_a_worker_dies_with_a_killed_service() -> None:
    """SIGKILL the service (here a child process with a pool) while its worker is busy: the fork
    server exits with it, and the worker, whose parent it is, gets SIGKILL too."""
    script = (
        "import asyncio, multiprocessing, sys, time\n"
        "from tokensvc.knowledge import ChunkingKind, ChunkingStrategy, ExtractionPool\n"
        "from tests.knowledge.worker_support import SLOW_HTML\n"
        "async def main():\n"
        "    pool = ExtractionPool(workers=1, limit_seconds=600, memory_bytes=2 * 1024**3)\n"
        "    strategy = ChunkingStrategy(ChunkingKind.RECURSIVE, 64, 8)\n"
        "    await pool.chunks(b'<p>warm</p>', 'text/html', strategy)\n"
        "    (worker,) = [p.pid for p in multiprocessing.active_children() if p.name == 'pebble_pool_worker']\n"
        "    print(worker, flush=True)\n"
        "    await pool.chunks(SLOW_HTML * 4, 'text/html', strategy)\n"
        "if __name__ == '__main__':\n"
        "    asyncio.run(main())\n"
    )
    root = Path(__file__).resolve().parents[2]
    service = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=root)
    try:
        assert service.stdout is not None
        worker = int(service.stdout.readline())
        asyncio.run(busy(worker))
        service.kill()
        service.wait()
        for _ in range(200):
            if not _running(worker):
                break
            time.sleep(0.05)
        assert not _running(worker), "the worker kept extracting after its service was killed"
    finally:
        service.kill()


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed child waits for its new parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
