"""`tokensvc capability ...` and `tokensvc session-key` against a live service."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from tokensvc.app import Service
from tokensvc.auth.devpki import DevPaths

ROOT = Path(__file__).resolve().parents[2]


async def tokensvc(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run the CLI without blocking the event loop the in-process server runs on."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("TOKENSVC_")}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tokensvc",
        *args,
        cwd=ROOT,
        env={**base, **(env or {})},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


def connection(service: Service, dev: DevPaths) -> list[str]:
    return ["--state-dir", str(dev.state_dir), "--target", f"127.0.0.1:{service.port}"]


async def mint(dev: DevPaths, *extra: str) -> str:
    code, out, err = await tokensvc("capability", "mint", "--state-dir", str(dev.state_dir), *extra)
    assert code == 0, err
    return out.strip()


async def test_minted_capability_verifies_and_derives_the_documented_session_key(
    service: Service, dev: DevPaths
) -> None:
    token = await mint(dev, "--namespace", "default", "--agent", "dev-agent", "--ltm", "--kb", "handbook")
    env = {"TOKENSVC_CAPABILITY": token}
    code, out, err = await tokensvc("capability", "verify", "--json", *connection(service, dev), env=env)
    assert code == 0, err
    scope = json.loads(out)["scope"]
    assert (scope["namespace"], scope["agent"], scope["knowledge_bases"]) == (
        "default",
        "dev-agent",
        ["handbook"],
    )
    assert scope["long_term_memory"] is True

    code, out, err = await tokensvc("session-key", "conv-42", *connection(service, dev), env=env)
    assert code == 0, err
    assert out.strip() == "mem:default/dev-agent:conv-42"


async def test_capability_file_is_read_and_a_bad_conversation_id_fails_readably(
    service: Service, dev: DevPaths, tmp_path: Path
) -> None:
    token_file = tmp_path / "cap"
    token_file.write_text(await mint(dev, "--namespace", "default", "--agent", "dev-agent"))
    code, _, err = await tokensvc(
        "session-key", "a/b", "--capability-file", str(token_file), *connection(service, dev)
    )
    assert code == 1
    assert "INVALID_ARGUMENT" in err
    assert "conversation_id" in err
    assert "Traceback" not in err


async def test_capability_for_another_agent_is_refused_with_its_reason(
    service: Service, dev: DevPaths
) -> None:
    token = await mint(dev, "--namespace", "default", "--agent", "someone-else")
    code, _, err = await tokensvc(
        "capability", "verify", *connection(service, dev), env={"TOKENSVC_CAPABILITY": token}
    )
    assert code == 1
    assert "PERMISSION_DENIED (BINDING_MISMATCH)" in err


async def test_missing_capability_is_a_readable_usage_error(service: Service, dev: DevPaths) -> None:
    code, _, err = await tokensvc("capability", "verify", *connection(service, dev))
    assert code == 2
    assert "TOKENSVC_CAPABILITY" in err


async def test_revoke_by_run_id_through_the_cli_refuses_the_run(service: Service, dev: DevPaths) -> None:
    token = await mint(dev, "--namespace", "default", "--agent", "dev-agent", "--run-id", "run-cli-revoke")
    code, _, err = await tokensvc(
        "capability", "revoke", "--run-id", "run-cli-revoke", *connection(service, dev)
    )
    assert code == 0, err
    code, _, err = await tokensvc(
        "capability", "verify", *connection(service, dev), env={"TOKENSVC_CAPABILITY": token}
    )
    assert code == 1
    assert "CAPABILITY_REVOKED" in err
