"""`workers` > 1: N server processes sharing one port, and the parent process that supervises them.

A tokensvc process is one Python interpreter with one event loop, so it uses about one core. On a
single large host without Kubernetes, `tokensvc serve --workers N` (setting `workers`) starts N
worker processes (spawned: nothing inherited but the settings) that each bind `listen_address`
with `grpc.so_reuseport` = 1; the kernel spreads incoming connections over them. Each worker is a
full server, as a replica is: its own database pool (so up to N x `pool_max_size` connections),
caches, background duties (health monitor, credential watch, sweeper, revocation poller, vector
indexes), and,
when `metrics_address` is host:P, its own metrics port P + worker index (0-based; port 0 stays 0:
each worker picks a free one). The parent serves nothing itself:

- the embedded PostgreSQL (no `database_dsn`) is started by the parent and handed to the
  workers by its DSN and credential directories; `migrate_on_start` runs once, in the parent,
  before any worker starts;
- SIGTERM or SIGINT to the parent is passed on to every worker as SIGTERM; each drains as a
  single server does (NOT_SERVING, `shutdown_grace_seconds` for in-flight calls). The parent
  exits 0 when all have stopped (a worker still running `shutdown_grace_seconds` + 15 s later is
  killed, and the exit is 1);
- a worker that exits while nobody asked it to is reported (an error log line with its index,
  pid and exit code); the parent then stops the others and exits non-zero (the worker's own exit
  code when it is positive, e.g. 2 for a setting it refused, else 1). It is not restarted in
  place: the process manager (systemd, a container runtime) restarts the whole server, the same
  way it would restart a single-process tokensvc. A worker whose parent is gone (killed with
  SIGKILL) drains and stops by itself within a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

from tokensvc.settings import Settings, SettingsError

if TYPE_CHECKING:
    from tokensvc.app import Service
    from tokensvc.storage.postgres import Database

__all__ = ["run_workers", "worker_settings"]

_log = logging.getLogger(__name__)
_POLL_SECONDS = 0.2
# A worker gets this long beyond shutdown_grace_seconds to exit after SIGTERM, then SIGKILL.
_STOP_MARGIN_SECONDS = 15.0


def worker_settings(settings: Settings, index: int) -> Settings:
    """Worker `index`'s settings: its metrics port is P + index; nothing else differs."""
    if settings.metrics_address is None:
        return settings
    host, _, port = settings.metrics_address.rpartition(":")
    if int(port) == 0:
        return settings
    return dataclasses.replace(settings, metrics_address=f"{host}:{int(port) + index}")


def run_workers(settings: Settings) -> int:
    """Start `settings.workers` workers on one port, supervise them, return the exit code."""
    return asyncio.run(_Supervisor(settings).run())


def _worker_main(settings: Settings, index: int, ready: Connection, parent: int) -> None:
    """A worker process: one Service until SIGTERM/SIGINT (app.run_service)."""
    from tokensvc.app import SchemaOutdated, run_service
    from tokensvc.logs import configure_logging

    configure_logging(settings.log_level)
    _stop_with_parent(parent)

    def started(service: Service) -> None:
        ready.send(service.port)
        ready.close()

    try:
        asyncio.run(run_service(settings, on_started=started, worker=index))
    except KeyboardInterrupt:
        sys.exit(130)
    except (SettingsError, SchemaOutdated) as exc:
        print(f"tokensvc: error: worker {index}: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)


def _stop_with_parent(parent: int) -> None:
    """SIGTERM to this worker (so it drains) once its parent is gone, e.g. killed with SIGKILL."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="tokensvc-parent-watch", daemon=True).start()


@dataclass
class _Worker:
    index: int
    process: BaseProcess
    ready: Connection | None  # None once the worker has reported that it serves

    @property
    def pid(self) -> int | None:
        return self.process.pid


def _require_free_port(address: str) -> None:
    """Refuse to start when anything already holds the port: the workers bind it with
    SO_REUSEPORT, which would otherwise quietly share its connections with a process of the same
    user that bound it the same way (an old instance, another tokensvc)."""
    host, _, port = address.rpartition(":")
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host.strip("[]") or "0.0.0.0", int(port)))  # noqa: S104 - the configured address
        except OSError as exc:
            raise SettingsError(f"listen_address: {address} is already in use ({exc.strerror})") from None


class _Supervisor:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.workers: list[_Worker] = []
        self._stop = asyncio.Event()

    async def run(self) -> int:
        # The files every worker needs, checked once here: a readable error, no worker started.
        self.settings.require_tls_files()
        self.settings.require_capability_files()
        _require_free_port(self.settings.listen_address)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        database, settings = await self._prepare_database()
        try:
            _log.info(
                "starting workers",
                extra={"workers": settings.workers, "address": settings.listen_address},
            )
            context = multiprocessing.get_context("spawn")
            for index in range(settings.workers):
                self.workers.append(self._spawn(context, settings, index))
            failed = await self._watch()
        finally:
            clean = await self._stop_all()
            if database is not None:
                await database.close()
        if failed is not None:
            code = failed.process.exitcode
            return code if code is not None and code > 0 else 1
        _log.info("workers stopped", extra={"workers": settings.workers, "clean": clean})
        return 0 if clean else 1

    async def _prepare_database(self) -> tuple[Database | None, Settings]:
        """Migrate once, and own the embedded PostgreSQL if there is one; the workers' settings."""
        settings = self.settings
        if not settings.embedded_database and not settings.migrate_on_start:
            return None, settings
        from tokensvc.app import locate_database, migrate

        database = await locate_database(settings)
        try:
            if settings.migrate_on_start:
                await migrate(database, settings)
            settings = dataclasses.replace(settings, migrate_on_start=False)
            embedded = database.embedded
            if embedded is None:
                await database.close()
                return None, settings
            paths = embedded.paths
            settings = dataclasses.replace(
                settings,
                database_dsn=embedded.dsn(),
                database_credential_dir=settings.database_credential_dir or paths.credential_dir("app"),
                database_owner_credential_dir=(
                    settings.database_owner_credential_dir or paths.credential_dir("owner")
                ),
                database_rotator_credential_dir=(
                    settings.database_rotator_credential_dir or paths.credential_dir("rotator")
                ),
                database_runner_credential_dir=(
                    settings.database_runner_credential_dir or paths.credential_dir("runner")
                ),
            ).validate()
        except BaseException:
            await database.close()
            raise
        return database, settings

    def _spawn(
        self, context: multiprocessing.context.SpawnContext, settings: Settings, index: int
    ) -> _Worker:
        parent_end, child_end = context.Pipe(duplex=False)
        process = context.Process(
            target=_worker_main,
            args=(worker_settings(settings, index), index, child_end, os.getpid()),
            name=f"tokensvc-worker-{index}",
        )
        process.start()
        child_end.close()
        return _Worker(index, process, parent_end)

    async def _watch(self) -> _Worker | None:
        """Until a stop is asked for (None) or a worker exits on its own (that worker)."""
        serving = 0
        while not self._stop.is_set():
            for worker in self.workers:
                if worker.ready is not None and _poll(worker.ready):
                    with contextlib.suppress(EOFError, OSError):
                        port = worker.ready.recv()
                        serving += 1
                        _log.info(
                            "worker serving",
                            extra={"worker": worker.index, "worker_pid": worker.pid, "port": port},
                        )
                        if serving == len(self.workers):
                            _log.info(
                                "serving",
                                extra={
                                    "workers": len(self.workers),
                                    "address": self.settings.listen_address,
                                    "worker_pids": [w.pid for w in self.workers],
                                },
                            )
                    worker.ready.close()
                    worker.ready = None
                if worker.process.exitcode is not None:
                    _log.error(
                        "worker exited unexpectedly; stopping the other workers",
                        extra={
                            "worker": worker.index,
                            "worker_pid": worker.pid,
                            "exit_code": worker.process.exitcode,
                        },
                    )
                    return worker
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), _POLL_SECONDS)
        _log.info("shutdown requested; stopping workers", extra={"workers": len(self.workers)})
        return None

    async def _stop_all(self) -> bool:
        """SIGTERM to every live worker, wait for all; True when every one exited cleanly."""
        for worker in self.workers:
            if worker.process.exitcode is None and worker.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.settings.shutdown_grace_seconds + _STOP_MARGIN_SECONDS
        clean = True
        for worker in self.workers:
            await asyncio.to_thread(worker.process.join, max(0.0, deadline - time.monotonic()))
            if worker.process.exitcode is None:
                _log.error("worker did not stop in time; killing it", extra={"worker": worker.index})
                worker.process.kill()
                await asyncio.to_thread(worker.process.join, 5)
                clean = False
            elif worker.process.exitcode not in (0, -signal.SIGTERM, -signal.SIGINT):
                clean = False
            if worker.ready is not None:
                worker.ready.close()
        return clean


def _poll(connection: Connection) -> bool:
    try:
        return connection.poll()
    except (EOFError, OSError):
        return True
