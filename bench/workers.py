"""The main process's handle on the load-generator process (bench/client.py)."""

from __future__ import annotations

import asyncio
import multiprocessing
from typing import Any

from bench.client import worker_main

__all__ = ["WorkerError", "WorkerHandle"]


class WorkerError(RuntimeError):
    """A command failed in the load generator; the message carries its traceback."""


class WorkerHandle:
    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")  # nothing inherited: no event loop, no gRPC state
        self._pipe, child = context.Pipe()
        self._process = context.Process(target=worker_main, args=(child,), name="bench-client", daemon=True)
        self._process.start()
        child.close()
        self._lock = asyncio.Lock()

    async def call(self, op: str, **kwargs: Any) -> Any:
        """Run `op` in the load generator; the main event loop keeps serving meanwhile."""
        async with self._lock:
            self._pipe.send((op, kwargs))
            status, result = await asyncio.to_thread(self._pipe.recv)
        if status != "ok":
            raise WorkerError(f"{op}: {result}")
        return result

    async def close(self) -> None:
        if self._process.is_alive():
            self._pipe.send(None)
            await asyncio.to_thread(self._process.join, 30)
        if self._process.is_alive():
            self._process.terminate()
        self._pipe.close()
