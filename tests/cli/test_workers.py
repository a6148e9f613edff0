"""`tokensvc serve --workers N`: N processes on one port, real sockets, mTLS, real signals."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.cli.test_cli import ROOT, TOKENSVC, clean_env, settings_env, wait_for_health
from tests.support import SharedDatabase, free_port
from tokensvc.auth.devpki import DevPaths, ensure_dev_material
from tokensvc.settings import SettingsError
from tokensvc.settings_sources import load_settings
from tokensvc.workers import worker_settings


@pytest.fixture
def cleanup() -> Iterator[list[Path]]:
    """Directories to remove after the test."""
    paths: list[Path] = []
    yield paths
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`tokensvc serve ARGS` to completion (a refusal: it must not start)."""
    return subprocess.run(
        [*TOKENSVC, "serve", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env or clean_env(),
    )


def log_entries(path: Path) -> list[dict[str, Any]]:
    entries = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            entries.append(json.loads(line))
    return entries


def serving_worker_pids(
    log: Path, server: subprocess.Popen[str], count: int, deadline_s: float = 90
) -> set[int]:
    """The pids of the workers the parent reported serving, once all `count` are."""
    started = time.monotonic()
    while time.monotonic() - started < deadline_s:
        if server.poll() is not None:
            raise AssertionError(f"tokensvc exited with {server.returncode}: {log.read_text()[-2000:]}")
        pids = {e["worker_pid"] for e in log_entries(log) if e.get("msg") == "worker serving"}
        if len(pids) == count:
            return pids
        time.sleep(0.3)
    raise AssertionError(f"not every worker was serving within {deadline_s} s")


async def health_checks_on_fresh_connections(port: int, dev: DevPaths, connections: int) -> None:
    """One Health.Check per new TCP connection (a local subchannel pool: no sharing)."""
    cert, key = dev.client("launcher")
    credentials = grpc.ssl_channel_credentials(
        root_certificates=dev.ca_cert.read_bytes(),
        private_key=key.read_bytes(),
        certificate_chain=cert.read_bytes(),
    )
    for _ in range(connections):
        channel = grpc.aio.secure_channel(
            f"127.0.0.1:{port}", credentials, options=[("grpc.use_local_subchannel_pool", 1)]
        )
        try:
            response = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
            assert response.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await channel.close(grace=None)


def rpc_pids(log: Path) -> set[int]:
    return {e["pid"] for e in log_entries(log) if e.get("logger") == "tokensvc.rpc" and e.get("msg") == "rpc"}


def scrape(port: int) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode("utf-8"))


def start_workers(
    database: SharedDatabase, dev: DevPaths, tmp_path: Path, workers: int, metrics_port: int | None = None
) -> tuple[subprocess.Popen[str], int, Path]:
    port = free_port()
    env = {**clean_env(), **settings_env(database, dev, tmp_path, port)}
    if metrics_port is not None:
        env["TOKENSVC_METRICS_ADDRESS"] = f"127.0.0.1:{metrics_port}"
    log = tmp_path / "stderr.log"
    with log.open("w") as stderr:
        server = subprocess.Popen(
            [*TOKENSVC, "serve", "--workers", str(workers)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            text=True,
        )
    return server, port, log


@pytest.mark.slow
def test_serve_with_two_workers_answers_on_one_port_from_both_processes_and_stops_cleanly(
    database: SharedDatabase, dev: DevPaths, tmp_path: Path, process_cleanup: list[subprocess.Popen[str]]
) -> None:
    metrics_port = free_port()
    server, port, log = start_workers(database, dev, tmp_path, 2, metrics_port)
    process_cleanup.append(server)
    workers = serving_worker_pids(log, server, 2)
    assert server.pid not in workers
    wait_for_health(dev.state_dir, port, server)

    # The kernel spreads connections over the workers: calls on fresh connections reach both.
    for _ in range(10):
        asyncio.run(health_checks_on_fresh_connections(port, dev, 16))
        if rpc_pids(log) == workers:
            break
    assert rpc_pids(log) == workers, f"RPCs were served by {rpc_pids(log)}, workers are {workers}"

    # Each worker serves its own metrics on P + index, and counted its own RPCs there.
    for index in range(2):
        text = scrape(metrics_port + index)
        assert 'tokensvc_rpcs_total{code="OK",method="/grpc.health.v1.Health/Check"}' in text

    server.send_signal(signal.SIGTERM)
    assert server.wait(60) == 0
    for pid in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    messages = [e["msg"] for e in log_entries(log) if e["pid"] == server.pid]
    assert "workers stopped" in messages
    assert sum(e["msg"] == "stopped" for e in log_entries(log)) == 2  # each worker drained and stopped


@pytest.mark.slow
def test_a_worker_that_dies_is_reported_and_the_server_exits_non_zero(
    database: SharedDatabase, dev: DevPaths, tmp_path: Path, process_cleanup: list[subprocess.Popen[str]]
) -> None:
    server, _, log = start_workers(database, dev, tmp_path, 2)
    process_cleanup.append(server)
    victim, survivor = sorted(serving_worker_pids(log, server, 2))
    os.kill(victim, signal.SIGKILL)
    assert server.wait(60) == 1
    (report,) = [e for e in log_entries(log) if e.get("msg", "").startswith("worker exited unexpectedly")]
    assert report["worker_pid"] == victim
    assert report["exit_code"] == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        os.kill(survivor, 0)  # the other worker was stopped too


@pytest.mark.slow
def test_workers_stop_by_themselves_when_their_parent_is_killed(
    database: SharedDatabase, dev: DevPaths, tmp_path: Path, process_cleanup: list[subprocess.Popen[str]]
) -> None:
    server, _, log = start_workers(database, dev, tmp_path, 2)
    process_cleanup.append(server)
    workers = serving_worker_pids(log, server, 2)
    server.kill()
    server.wait(10)
    deadline = time.monotonic() + 30
    alive = set(workers)
    while alive and time.monotonic() < deadline:
        for pid in list(alive):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                alive.discard(pid)
        time.sleep(0.2)
    assert not alive, f"workers {alive} outlived their parent"
    assert sum(e["msg"] == "stopped" for e in log_entries(log)) == 2


@pytest.mark.slow
def test_workers_on_the_embedded_database_share_one_postgres_the_parent_starts_and_stops(
    tmp_path: Path, process_cleanup: list[subprocess.Popen[str]], cleanup: list[Path]
) -> None:
    # Outside pytest's basetemp, as tests/conftest.py's database (PostgreSQL runs unprivileged).
    state = Path(tempfile.mkdtemp(prefix="tokensvc-test-workers-"))
    cleanup.append(state)
    dev = ensure_dev_material(state)
    port = free_port()
    env = {
        **clean_env(),
        "TOKENSVC_STATE_DIR": str(state),
        "TOKENSVC_LISTEN_ADDRESS": f"127.0.0.1:{port}",
        "TOKENSVC_TLS_CERT_FILE": str(dev.server_cert),
        "TOKENSVC_TLS_KEY_FILE": str(dev.server_key),
        "TOKENSVC_TLS_CLIENT_CA_FILE": str(dev.ca_cert),
        "TOKENSVC_TRUST_BUNDLE_FILE": str(dev.trust_bundle),
        "TOKENSVC_PEPPER_DIR": str(dev.pepper_dir),
        "TOKENSVC_MIGRATE_ON_START": "true",
        "TOKENSVC_WORKERS": "2",
    }
    log = tmp_path / "stderr.log"
    with log.open("w") as stderr:
        server = subprocess.Popen(
            [*TOKENSVC, "serve"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr
        )
    process_cleanup.append(server)
    serving_worker_pids(log, server, 2)
    wait_for_health(state, port, server)
    assert (state / "postgres/data/postmaster.pid").exists()
    server.send_signal(signal.SIGTERM)
    assert server.wait(60) == 0
    assert not (state / "postgres/data/postmaster.pid").exists()  # the parent stopped PostgreSQL


def test_workers_need_a_fixed_port_and_a_sane_count(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="listen_address"):
        load_settings(environ={}, overrides={"workers": 2, "listen_address": "127.0.0.1:0"})
    with pytest.raises(SettingsError, match="workers"):
        load_settings(environ={}, overrides={"workers": 0})
    with pytest.raises(SettingsError, match="metrics_address"):
        load_settings(environ={}, overrides={"workers": 4, "metrics_address": "127.0.0.1:65534"})
    assert load_settings(environ={"TOKENSVC_WORKERS": "3"}).workers == 3


def test_each_worker_serves_metrics_on_its_own_port() -> None:
    settings = load_settings(environ={}, overrides={"workers": 3, "metrics_address": "0.0.0.0:9464"})
    assert [worker_settings(settings, i).metrics_address for i in range(3)] == [
        "0.0.0.0:9464",
        "0.0.0.0:9465",
        "0.0.0.0:9466",
    ]
    anywhere = load_settings(environ={}, overrides={"workers": 2, "metrics_address": "127.0.0.1:0"})
    assert worker_settings(anywhere, 1).metrics_address == "127.0.0.1:0"
    assert worker_settings(load_settings(environ={}), 0).metrics_address is None


def test_serve_rejects_a_bad_worker_count_readably() -> None:
    result = serve("--workers", "0")
    assert result.returncode == 2
    assert "workers" in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_with_workers_without_tls_files_refuses_before_starting_any() -> None:
    result = serve(
        "--workers", "2", env={**clean_env(), "TOKENSVC_LISTEN_ADDRESS": f"127.0.0.1:{free_port()}"}
    )
    assert result.returncode == 2
    assert "mTLS only" in result.stderr
    assert "starting workers" not in result.stderr


def test_serve_with_workers_refuses_a_port_someone_already_holds(
    database: SharedDatabase, dev: DevPaths, tmp_path: Path
) -> None:
    # The workers bind with SO_REUSEPORT; a holder that did the same would share the connections.
    import socket

    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("127.0.0.1", port))
        holder.listen()
        result = serve("--workers", "2", env={**clean_env(), **settings_env(database, dev, tmp_path, port)})
    assert result.returncode == 2, result.stderr
    assert "already in use" in result.stderr
    assert "starting workers" not in result.stderr
