"""Crash safety: `tokensvc dev` SIGKILLed under Remember traffic and knowledge uploads, then restarted.

tokensvc runs as a real process on its own state dir (embedded PostgreSQL, dev PKI). While tasks
call Remember for two tenants and upload new versions of knowledge-base documents over mTLS, the
process is SIGKILLed. Its PostgreSQL runs in its own session and survives; the restarted process
must adopt it (same postmaster). After each restart:
- every acknowledged memory is present with its content; nothing is half-written, no failed
  batch is stored in part;
- the knowledge tables are consistent: no chunk without its document, no document whose
  chunk_count differs from its chunks, every chunk of its document's current version;
- every document is at its last acknowledged version, or at the version its interrupted upload
  would have written (that one may have committed) and never anything else;
- SearchKnowledge finds the current version's text and never a superseded version's.
Two rounds: the second kill hits a process that had adopted the postmaster.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.api.knowledge_support import MARKDOWN, Manager, Searcher, mint, new_ref
from tests.faults.harness import (
    RememberTraffic,
    Tenants,
    check_remembered,
    knowledge_violations,
    new_state_dir,
    postmaster_pid,
    report,
    stop_postmaster,
    superuser,
    wait_until,
)
from tests.support import free_port, role_channel
from tokensvc.auth.devpki import DevPaths, ensure_dev_material

ROOT = Path(__file__).resolve().parents[2]
RPC_TIMEOUT = 20.0
ROUNDS = 2
MEMORY_WORKERS = 4
UPLOAD_WORKERS = 3
DOCUMENTS_PER_WORKER = 2
WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "xray",
    "yankee",
    "zulu",
]


class TokensvcProcess:
    """`python -m tokensvc dev` on a state dir and port; started, SIGKILLed and restarted."""

    def __init__(self, state: Path, port: int, logs: Path):
        self.state = state
        self.port = port
        self.logs = logs
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {key: value for key, value in os.environ.items() if not key.startswith("TOKENSVC_")}
        env |= {
            "TOKENSVC_HEALTH_CHECK_INTERVAL_SECONDS": "0.5",
            "TOKENSVC_SHUTDOWN_GRACE_SECONDS": "2",
            # Crash safety, not meaning: the instant `hash` embedder keeps the traffic dense.
            "TOKENSVC_MEMORY_EMBEDDER": "hash",
        }
        with (self.logs / "stdout.log").open("ab") as out, (self.logs / "stderr.log").open("ab") as err:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tokensvc",
                    "dev",
                    "--state-dir",
                    str(self.state),
                    "--port",
                    str(self.port),
                ],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=err,
            )

    async def wait_serving(self, dev: DevPaths, within: float = 90) -> float:
        """Seconds until Health.Check answers SERVING over mTLS; fails if the process exits."""
        started = time.monotonic()
        async with role_channel(self.port, dev, "launcher") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() - started < within:
                assert self.process is not None
                if self.process.poll() is not None:
                    raise AssertionError(f"tokensvc exited with {self.process.returncode}; see {self.logs}")
                with contextlib.suppress(grpc.aio.AioRpcError):
                    response = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if response.status == health_pb2.HealthCheckResponse.SERVING:
                        return time.monotonic() - started
                await asyncio.sleep(0.1)
        raise AssertionError(f"tokensvc was not SERVING within {within} s; see {self.logs}")

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(30)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(30)


def document_text(worker: int, doc: int, version: int) -> str:
    """A Markdown document unique to (worker, doc, version); every chunk carries the version's marker."""
    rng = random.Random(f"{worker}/{doc}/{version}")
    marker = marker_of(worker, doc, version)
    sections = [
        f"## Part {section} {marker}\n\n{' '.join(rng.choice(WORDS) for _ in range(rng.randint(40, 90)))} {marker}.\n"
        for section in range(rng.randint(8, 16))
    ]
    return f"# Document {worker}.{doc}\n\n" + "\n".join(sections)


def marker_of(worker: int, doc: int, version: int) -> str:
    return f"mk{worker}x{doc}x{version}z"  # no marker is a prefix of another


@dataclass(frozen=True)
class Upload:
    sha256: str
    text: str
    marker: str  # a word only this upload's text contains


@dataclass
class DocumentLog:
    """What one document's uploads did: acknowledged versions, and the call interrupted by the crash."""

    ref: str
    worker: int
    doc: int
    attempts: int = 0
    acknowledged: list[tuple[int, Upload]] = field(default_factory=list)  # (version, upload)
    interrupted: Upload | None = None  # a failed upload: it may or may not have committed

    def allowed(self) -> dict[str, tuple[int, Upload]]:
        """sha256 -> (version, upload) the stored document may be at: the last acknowledged, or
        the interrupted upload as the next version."""
        allowed: dict[str, tuple[int, Upload]] = {}
        last = self.acknowledged[-1][0] if self.acknowledged else 0
        if self.acknowledged:
            allowed[self.acknowledged[-1][1].sha256] = self.acknowledged[-1]
        if self.interrupted is not None:
            allowed[self.interrupted.sha256] = (last + 1, self.interrupted)
        return allowed

    def settle(self, stored: tuple[int, str] | None) -> bool:
        """Forget the interrupted upload, keeping it as a version if it committed (returned)."""
        interrupted, self.interrupted = self.interrupted, None
        if interrupted is None or stored is None or stored[1] != interrupted.sha256:
            return False
        self.acknowledged.append((stored[0], interrupted))
        return True


class UploadTraffic:
    """Workers uploading new versions of their own documents; each stops at its first failure."""

    def __init__(self, manager: Manager, kb_ref: str, documents: dict[str, DocumentLog]):
        self._manager = manager
        self._kb_ref = kb_ref
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.documents = documents

    def start(self) -> None:
        workers = sorted({log.worker for log in self.documents.values()})
        self._tasks = [asyncio.create_task(self._work(worker)) for worker in workers]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    def acknowledged(self) -> int:
        return sum(len(log.acknowledged) for log in self.documents.values())

    async def _work(self, worker: int) -> None:
        mine = [log for log in self.documents.values() if log.worker == worker]
        turn = 0
        while not self._stop.is_set():
            log = mine[turn % len(mine)]
            turn += 1
            if log.interrupted is not None:
                return
            log.attempts += 1
            text = document_text(worker, log.doc, log.attempts)
            upload = Upload(
                hashlib.sha256(text.encode()).hexdigest(), text, marker_of(worker, log.doc, log.attempts)
            )
            try:
                response = await self._manager.upload(self._kb_ref, log.ref, text)
            except grpc.aio.AioRpcError:
                log.interrupted = upload
                return
            assert not response.unchanged
            assert response.document.content_sha256 == upload.sha256
            log.acknowledged.append((int(response.document.version), upload))


@pytest.fixture
async def crash_state() -> AsyncIterator[Path]:
    state = new_state_dir("crash")
    try:
        yield state
    finally:
        await stop_postmaster(state)
        shutil.rmtree(state, ignore_errors=True)


@pytest.mark.slow
async def test_sigkill_under_write_traffic_loses_nothing_acknowledged(
    crash_state: Path, tmp_path: Path
) -> None:
    state = crash_state
    dev = ensure_dev_material(state)  # `tokensvc dev` finds it and creates nothing new
    tenants = Tenants(dev, tmp_path / "clients")
    callers = [tenants.tenant(), tenants.tenant(user="user-1", per_user=True)]
    server = TokensvcProcess(state, free_port(), tmp_path)
    kb_ref = new_ref()
    documents = {
        f"doc-{worker}-{doc}": DocumentLog(f"doc-{worker}-{doc}", worker, doc)
        for worker in range(UPLOAD_WORKERS)
        for doc in range(DOCUMENTS_PER_WORKER)
    }
    memory_log: list[RememberTraffic] = []
    try:
        server.start()
        first_start = await server.wait_serving(dev)
        async with role_channel(server.port, dev, "control-plane") as channel:
            await Manager(channel).create(kb_ref, MARKDOWN, 64, 8)
        for round_ in range(ROUNDS):
            # Each round: traffic, SIGKILL mid-traffic, restart on the same state dir and port.
            memory = RememberTraffic(server.port, tenants, callers, MEMORY_WORKERS, RPC_TIMEOUT)
            memory_log.append(memory)
            postmaster = await kill_under_traffic(server, dev, memory, kb_ref, documents)

            # The embedded PostgreSQL outlived tokensvc; the restarted process adopts it.
            assert postmaster_pid(state) == postmaster
            server.start()
            restart = await server.wait_serving(dev)
            assert postmaster_pid(state) == postmaster

            outcome = await check_remembered(state, memory_log, callers)
            stored, passages = await check_knowledge(state, server.port, dev, kb_ref, documents)
            interrupted = sum(1 for log in documents.values() if log.interrupted is not None)
            committed = sum(log.settle(stored.get(ref)) for ref, log in documents.items())
            report(
                f"crash safety (round {round_ + 1})",
                first_start_to_serving_s=first_start,
                restart_to_serving_s=restart,
                acknowledged_memories=outcome.acknowledged,
                failed_remember_calls_committed_anyway=outcome.committed_anyway,
                acknowledged_uploads=sum(len(log.acknowledged) for log in documents.values()) - committed,
                interrupted_uploads=interrupted,
                interrupted_uploads_committed=committed,
                passages_checked=passages,
            )
    finally:
        server.stop()
    # Stopping the restarted tokensvc also stopped the PostgreSQL it had adopted.
    assert postmaster_pid(state) is None


async def kill_under_traffic(
    server: TokensvcProcess,
    dev: DevPaths,
    memory: RememberTraffic,
    kb_ref: str,
    documents: dict[str, DocumentLog],
) -> int:
    """Run Remember and upload traffic, SIGKILL tokensvc mid-traffic; the postmaster's pid."""
    async with role_channel(server.port, dev, "control-plane") as channel:
        uploads = UploadTraffic(Manager(channel), kb_ref, documents)
        memory.start()
        uploads.start()
        try:
            before = uploads.acknowledged()
            await wait_until(
                lambda: memory.acknowledged() >= 150 and uploads.acknowledged() >= before + 8,
                90,
                "write traffic before the kill",
            )
            postmaster = postmaster_pid(server.state)
            assert postmaster is not None
            server.kill()
            await asyncio.sleep(0.3)  # calls in flight fail now; a few more find no server
        finally:
            await memory.stop()
            await uploads.stop()
    return postmaster


async def check_knowledge(
    state: Path, port: int, dev: DevPaths, kb_ref: str, documents: dict[str, DocumentLog]
) -> tuple[dict[str, tuple[int, str]], int]:
    """Consistency, versions and search after a restart; (ref -> stored (version, sha256), passages checked)."""
    async with superuser(state) as conn:
        # An upload the crash interrupted may have been stored: the restarted service ingests it
        # in the background (and it then becomes the document's version), so the check waits
        # until nothing is left on its way in.
        began = time.monotonic()
        while await conn.fetchval(
            "SELECT count(*) FROM ingestions WHERE namespace = 'default' AND kb_ref = $1 AND state <> 'failed'",
            kb_ref,
        ):
            assert time.monotonic() - began < 180, "the interrupted uploads were never ingested"
            await asyncio.sleep(0.2)
        violations = await knowledge_violations(conn)
        rows = await conn.fetch(
            "SELECT ref, version, encode(content_sha256, 'hex') AS sha FROM documents "
            "WHERE namespace = 'default' AND kb_ref = $1",
            kb_ref,
        )
    assert not violations, f"inconsistent knowledge tables: {violations}"
    stored = {row["ref"]: (int(row["version"]), str(row["sha"])) for row in rows}
    assert set(stored) <= set(documents), f"documents nobody uploaded: {set(stored) - set(documents)}"
    current: dict[str, Upload] = {}
    for ref, log in documents.items():
        if ref not in stored:
            assert not log.acknowledged, f"{ref}: acknowledged versions are gone"
            continue
        version, digest = stored[ref]
        allowed = log.allowed()
        assert digest in allowed, f"{ref}: stored content is neither acknowledged nor the interrupted upload"
        assert allowed[digest][0] == version, f"{ref}: stored as v{version}, expected v{allowed[digest][0]}"
        current[ref] = allowed[digest][1]

    checked = 0
    async with role_channel(port, dev, "launcher") as channel:
        searcher = Searcher(channel, mint(dev, [kb_ref]))
        for ref, upload in current.items():
            # Hybrid search for the current version's marker: found, and only current text comes back.
            passages = await searcher.search(upload.marker, [kb_ref], top_k=10)
            assert [p for p in passages if p.document_ref == ref and upload.marker in p.text], (
                f"{ref}: SearchKnowledge did not find the current version"
            )
            for passage in passages:
                assert passage.text in current[passage.document_ref].text, (
                    f"{passage.citation}: not current text"
                )
            checked += len(passages)
            # A superseded version's marker is in no passage any more.
            for _, old in documents[ref].acknowledged:
                if old.marker != upload.marker:
                    found = await searcher.search(old.marker, [kb_ref], top_k=10)
                    assert not [p for p in found if old.marker in p.text], (
                        f"{ref}: a superseded version is searchable"
                    )
                    checked += len(found)
    return stored, checked
