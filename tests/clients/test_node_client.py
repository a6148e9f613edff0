"""The Node.js client (clients/node) against a live in-process tokensvc over mTLS.

Runs `node --test clients/node/test/live.test.mjs` with the connection info in the environment:
remember, search, derive a session key, and a PERMISSION_DENIED with reason BINDING_MISMATCH. The
server runs on this test's event loop, so node runs as an asyncio subprocess.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
from pathlib import Path

import pytest

from tests.conftest import ServiceFactory
from tests.support import dev_capability
from tokensvc.auth.devpki import DevPaths

REPO = Path(__file__).resolve().parents[2]
CLIENT_DIR = REPO / "clients" / "node"
LIVE_TEST = CLIENT_DIR / "test" / "live.test.mjs"
NPM_CI_TIMEOUT = 240.0
NODE_TEST_TIMEOUT = 120.0
# The node test file's cases; a run that executed fewer (or skipped any) did not test the client.
EXPECTED_NODE_TESTS = 6


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"`{name}` is not on PATH: the Node client test needs Node.js >= 20 and npm", pytrace=False
        )
    return path


async def run(
    argv: list[str], *, cwd: Path, time_limit: float, env: dict[str, str] | None = None
) -> tuple[int, str]:
    """Run a command without blocking the event loop; (exit code, combined output)."""
    process = await asyncio.create_subprocess_exec(
        *argv,
        cwd=cwd,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,  # its own process group, so a timeout ends npm's children too
    )
    try:
        output, _ = await asyncio.wait_for(process.communicate(), time_limit)
    except TimeoutError:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = await process.communicate()
        pytest.fail(
            f"{' '.join(argv)} did not finish within {time_limit:.0f} s:\n{output.decode(errors='replace')}",
            pytrace=False,
        )
    assert process.returncode is not None
    return process.returncode, output.decode(errors="replace")


async def ensure_node_modules() -> None:
    """`npm ci` when node_modules is missing or older than package-lock.json."""
    installed = CLIENT_DIR / "node_modules" / ".package-lock.json"  # npm writes it last
    lock = CLIENT_DIR / "package-lock.json"
    if installed.exists() and installed.stat().st_mtime >= lock.stat().st_mtime:
        return
    npm = require_tool("npm")
    code, output = await run(
        [npm, "ci", "--no-audit", "--no-fund", "--ignore-scripts"], cwd=CLIENT_DIR, time_limit=NPM_CI_TIMEOUT
    )
    if code != 0:
        pytest.fail(f"npm ci in {CLIENT_DIR} failed (exit {code}):\n{output}", pytrace=False)


def capability(dev: DevPaths, agent: str) -> str:
    return dev_capability(dev, agent=agent, long_term_memory=True)


@pytest.mark.slow
@pytest.mark.timeout(NPM_CI_TIMEOUT + NODE_TEST_TIMEOUT + 60)
async def test_node_client_against_a_live_server(start_service: ServiceFactory, dev: DevPaths) -> None:
    node = require_tool("node")
    await ensure_node_modules()
    service = await start_service()
    cert, key = dev.client("launcher")  # spiffe://dev.local/ns/default/sa/dev-agent
    env = {
        **os.environ,
        "TOKENSVC_TARGET": f"127.0.0.1:{service.port}",
        "TOKENSVC_CA": str(dev.ca_cert),
        "TOKENSVC_CERT": str(cert),
        "TOKENSVC_KEY": str(key),
        "TOKENSVC_CAPABILITY": capability(dev, "dev-agent"),
        "OTHER_AGENT_CAPABILITY": capability(dev, "other-agent"),
        "NODE_OPTIONS": "",
    }
    code, output = await run(
        [node, "--test", "--test-reporter=tap", str(LIVE_TEST)],
        cwd=REPO,
        env=env,
        time_limit=NODE_TEST_TIMEOUT,
    )
    assert code == 0, f"node --test failed (exit {code}):\n{output}"
    counts = {
        name: int(n) for name, n in re.findall(r"^# (pass|fail|cancelled|skipped|todo) (\d+)$", output, re.M)
    }
    assert counts == {"pass": EXPECTED_NODE_TESTS, "fail": 0, "cancelled": 0, "skipped": 0, "todo": 0}, output
