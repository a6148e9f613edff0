"""The `tokensvc` command as a user runs it: real processes, real ports, real signals."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from tests.support import SharedDatabase, free_port, role_channel, service_settings
from tokensvc.auth.devpki import DevPaths
from tokensvc.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
TOKENSVC = [sys.executable, "-m", "tokensvc"]


def run(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TOKENSVC, *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**clean_env(), **(env or {})},
    )


def clean_env() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if not key.startswith("TOKENSVC_")}


def settings_env(database: SharedDatabase, dev: DevPaths, state: Path, port: int) -> dict[str, str]:
    settings = service_settings(database, dev, state)
    return {
        "TOKENSVC_LISTEN_ADDRESS": f"127.0.0.1:{port}",
        "TOKENSVC_STATE_DIR": str(state),
        "TOKENSVC_DATABASE_DSN": str(settings.database_dsn),
        "TOKENSVC_DATABASE_CREDENTIAL_DIR": str(settings.database_credential_dir),
        "TOKENSVC_DATABASE_RUNNER_CREDENTIAL_DIR": str(settings.database_runner_credential_dir),
        "TOKENSVC_TLS_CERT_FILE": str(dev.server_cert),
        "TOKENSVC_TLS_KEY_FILE": str(dev.server_key),
        "TOKENSVC_TLS_CLIENT_CA_FILE": str(dev.ca_cert),
        "TOKENSVC_TRUST_BUNDLE_FILE": str(dev.trust_bundle),
        "TOKENSVC_PEPPER_DIR": str(dev.pepper_dir),
        "TOKENSVC_SHUTDOWN_GRACE_SECONDS": "10",
    }


def wait_for_health(
    state_dir: Path,
    port: int,
    server: subprocess.Popen[str],
    deadline_s: float = 60,
    stderr: Path | None = None,
) -> float:
    started = time.monotonic()
    while time.monotonic() - started < deadline_s:
        if server.poll() is not None:
            said = (
                ""
                if stderr is None
                else "; its stderr ends:\n" + "\n".join(stderr.read_text().splitlines()[-15:])
            )
            raise AssertionError(f"tokensvc exited with {server.returncode}{said}")
        result = run(
            "health", "--state-dir", str(state_dir), "--target", f"127.0.0.1:{port}", "--timeout", "2"
        )
        if result.returncode == 0:
            return time.monotonic() - started
        time.sleep(0.3)
    raise AssertionError(f"tokensvc did not become healthy in {deadline_s} s")


def all_commands() -> list[list[str]]:
    parser = build_parser()
    found: list[list[str]] = [[]]

    def walk(p: object, prefix: list[str]) -> None:
        for action in getattr(p, "_actions", []):
            choices = getattr(action, "choices", None)
            if isinstance(choices, dict):
                for name, sub in choices.items():
                    found.append([*prefix, name])
                    walk(sub, [*prefix, name])

    walk(parser, [])
    return found


@pytest.mark.parametrize("command", all_commands(), ids=lambda c: " ".join(c) or "tokensvc")
def test_every_command_has_help(command: list[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args([*command, "--help"])
    assert caught.value.code == 0


def test_bad_setting_exits_2_with_a_readable_error_naming_it() -> None:
    result = run("serve", env={"TOKENSVC_POOL_MAX_SIZE": "lots"})
    assert result.returncode == 2
    assert "TOKENSVC_POOL_MAX_SIZE" in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_without_tls_files_refuses_to_start() -> None:
    result = run("serve")
    assert result.returncode == 2
    assert "mTLS only" in result.stderr


def test_health_reports_unreachable_with_exit_1(dev: DevPaths) -> None:
    result = run(
        "health",
        "--state-dir",
        str(dev.state_dir),
        "--target",
        f"127.0.0.1:{free_port()}",
        "--timeout",
        "1",
        "--json",
    )
    assert result.returncode == 1
    assert '"status": "UNREACHABLE' in result.stdout


@pytest.mark.slow
def test_sigterm_drains_an_in_flight_rpc_before_exit(
    database: SharedDatabase, dev: DevPaths, tmp_path: Path, process_cleanup: list[subprocess.Popen[str]]
) -> None:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.cli.slow_server"],
        cwd=ROOT,
        env={**clean_env(), **settings_env(database, dev, tmp_path, port)},
        stdout=(tmp_path / "stdout.log").open("w"),
        stderr=(tmp_path / "stderr.log").open("w"),
        text=True,
    )
    process_cleanup.append(server)
    wait_for_health(dev.state_dir, port, server, stderr=tmp_path / "stderr.log")

    async def call_then_terminate() -> bytes:
        async with role_channel(port, dev, "launcher") as channel:
            sleep = channel.unary_unary("/test.Slow/Sleep")
            call = sleep(b"hello", timeout=30)
            await asyncio.sleep(0.5)  # the RPC is now in flight
            server.send_signal(signal.SIGTERM)
            result: bytes = await call
            return result

    assert asyncio.run(call_then_terminate()) == b"finished:hello"
    assert server.wait(30) == 0

    async def after() -> None:
        async with role_channel(port, dev, "launcher") as channel:
            await channel.unary_unary("/test.Slow/Sleep")(b"late", timeout=2)

    with pytest.raises(grpc.RpcError):
        asyncio.run(after())


@pytest.mark.slow
def test_dev_brings_the_service_up_on_embedded_defaults(
    tmp_path: Path, process_cleanup: list[subprocess.Popen[str]]
) -> None:
    state = tmp_path / "state"
    port = free_port()
    server = subprocess.Popen(
        [*TOKENSVC, "dev", "--state-dir", str(state), "--port", str(port)],
        cwd=ROOT,
        env=clean_env(),
        stdout=(tmp_path / "stdout.log").open("w"),
        stderr=(tmp_path / "stderr.log").open("w"),
        text=True,
    )
    process_cleanup.append(server)
    waited = wait_for_health(state, port, server, stderr=tmp_path / "stderr.log")
    assert waited < 60
    for expected in ("pki/ca.crt", "pki/launcher.crt", "keys/trust-bundle.jwks", "secrets/peppers/v1"):
        assert (state / expected).is_file(), expected
    server.send_signal(signal.SIGINT)
    assert server.wait(60) == 0
    # The embedded PostgreSQL was stopped with the service.
    pid_file = state / "postgres/data/postmaster.pid"
    assert not pid_file.exists()


def test_certs_issue_makes_a_certificate_the_server_accepts_with_its_spiffe_id(
    dev: DevPaths, tmp_path: Path
) -> None:
    from cryptography import x509

    result = run(
        "certs",
        "issue",
        "--state-dir",
        str(dev.state_dir),
        "--spiffe-id",
        "spiffe://dev.local/ns/team/sa/helper",
        "--out",
        str(tmp_path),
        "--json",
    )
    assert result.returncode == 0, result.stderr
    cert = x509.load_pem_x509_certificate((tmp_path / "client.crt").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [
        "spiffe://dev.local/ns/team/sa/helper"
    ]


def test_certs_issue_rejects_a_bad_spiffe_id_readably(dev: DevPaths, tmp_path: Path) -> None:
    result = run(
        "certs",
        "issue",
        "--state-dir",
        str(dev.state_dir),
        "--spiffe-id",
        "https://x",
        "--out",
        str(tmp_path),
    )
    assert result.returncode == 2
    assert "tokensvc: error:" in result.stderr
