"""`tokensvc memory ...` against a live service, as a launcher would script it."""

from __future__ import annotations

import json
import uuid

from tests.cli.test_capability_cli import connection, mint, tokensvc
from tokensvc.app import Service
from tokensvc.auth.devpki import DevPaths


async def test_remember_search_list_and_forget_all_through_the_cli(service: Service, dev: DevPaths) -> None:
    user = f"cli-user-{uuid.uuid4().hex[:8]}"
    token = await mint(
        dev, "--namespace", "default", "--agent", "dev-agent", "--ltm", "--user", user, "--per-user"
    )
    env = {"TOKENSVC_CAPABILITY": token}
    conn = connection(service, dev)

    code, out, err = await tokensvc(
        "memory",
        "remember",
        "The staging cluster lives in eu-west-3",
        "--metadata",
        "topic=infra",
        "--metadata",
        "priority=2",
        "--json",
        *conn,
        env=env,
    )
    assert code == 0, err
    memory_id = json.loads(out)["results"][0]["id"]

    code, out, err = await tokensvc("memory", "search", "staging cluster", "--json", *conn, env=env)
    assert code == 0, err
    results = json.loads(out)["results"]
    assert results[0]["memory"]["id"] == memory_id
    assert results[0]["memory"]["metadata"]["priority"] == {"number_value": 2.0}

    only_low = '{"field": {"key": "priority", "operator": "FILTER_OPERATOR_LT", "value": {"numberValue": 2}}}'
    code, out, err = await tokensvc(
        "memory", "search", "staging", "--filter", only_low, "--json", *conn, env=env
    )
    assert code == 0, err
    assert json.loads(out).get("results", []) == []

    code, out, err = await tokensvc("memory", "list", *conn, env=env)
    assert code == 0, err
    assert memory_id in out

    code, out, err = await tokensvc("memory", "forget-all", "--json", *conn, env=env)
    assert code == 0, err
    assert json.loads(out)["forgotten_count"] == "1"  # proto JSON writes int64 as a string


async def test_bad_filter_json_is_a_readable_error(service: Service, dev: DevPaths) -> None:
    token = await mint(dev, "--namespace", "default", "--agent", "dev-agent", "--ltm")
    code, _, err = await tokensvc(
        "memory",
        "search",
        "x",
        "--filter",
        "{not json",
        *connection(service, dev),
        env={"TOKENSVC_CAPABILITY": token},
    )
    assert code == 2
    assert "--filter" in err
    assert "Traceback" not in err
