"""The main process's handle on a load-generator process, and the loop that process runs.

The caller of a benchmark runs in a spawned process of its own (nothing inherited: no event loop,
no gRPC state), the way a launcher is a separate process: tokensvc's event loop serves only
tokensvc. The process builds one object and runs its async methods by name, one at a time.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Protocol

__all__ = ["WorkerError", "WorkerHandle", "serve"]


class WorkerError(RuntimeError):
    """A command failed in the load generator; the message carries its traceback."""


class _Closable(Protocol):
    async def close(self) -> None: ...


def serve(pipe: Connection, factory: Callable[[], _Closable]) -> None:
    """The load generator's loop: `(op, kwargs)` in, `("ok", result)` or `("error", text)` out."""
    asyncio.run(_serve(pipe, factory))


async def _serve(pipe: Connection, factory: Callable[[], _Closable]) -> None:
    worker = factory()
    loop = asyncio.get_running_loop()
    try:
        while True:
            message = await loop.run_in_executor(None, pipe.recv)
            if message is None:
                return
            op, kwargs = message
            try:
                result = await getattr(worker, op)(**kwargs)
                pipe.send(("ok", result))
            except Exception as exc:  # reported to the main process, which raises
                pipe.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        await worker.close()


class WorkerHandle:
    """Starts `target(pipe)` in a spawned process (e.g. bench.client.worker_main)."""

    def __init__(self, target: Callable[[Connection], None], name: str = "bench-client") -> None:
        context = multiprocessing.get_context("spawn")
        self._pipe, child = context.Pipe()
        self._process = context.Process(target=target, args=(child,), name=name, daemon=True)
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
