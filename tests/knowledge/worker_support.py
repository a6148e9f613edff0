"""What the extraction tests share: a document that takes seconds to extract, and the workers."""

from __future__ import annotations

import asyncio
import multiprocessing
import os

# 2 MB of one-letter paragraphs, the costliest HTML per byte we know of: about 4 s to extract on
# the reference machine (a paragraph is a parsed element and a rendered block) but 0.1 s to
# send, so a deadline or limit of a second or two passes while a worker is busy with it.
SLOW_HTML = b"<p>a</p>" * 250_000


def extraction_workers() -> frozenset[int]:
    """Process ids of the live extraction workers of every pool in this process."""
    return frozenset(
        process.pid
        for process in multiprocessing.active_children()
        if process.name == "pebble_pool_worker" and process.pid is not None
    )


async def killed(pids: frozenset[int], wait_seconds: float = 20.0) -> frozenset[int]:
    """Those of `pids` that exited, once at least one has (or `wait_seconds` passed): a killed
    worker is reaped by the pool's own thread, a moment after the call has been answered."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + wait_seconds
    while True:
        gone = frozenset(pid for pid in pids if not _alive(pid))
        if gone or loop.time() > give_up:
            return gone
        await asyncio.sleep(0.05)


async def busy(pid: int, wait_seconds: float = 20.0) -> None:
    """Return once process `pid` has used CPU since the call: a worker that took its task."""
    loop = asyncio.get_running_loop()
    start, give_up = cpu_ticks(pid), loop.time() + wait_seconds
    while cpu_ticks(pid) == start:
        if loop.time() > give_up:
            raise AssertionError(f"process {pid} never started working")
        await asyncio.sleep(0.02)


def cpu_ticks(pid: int) -> int:
    """User plus system CPU time of `pid` in clock ticks (/proc/PID/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return pid in extraction_workers()  # an exited child not yet reaped is a zombie: not alive
