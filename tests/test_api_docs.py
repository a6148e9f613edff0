"""docs/api.md stays true to the API: every RPC has a section, the error table is the code's table,
and every `tokensvc` command it shows parses with the real CLI."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from tokensvc.api.status import status_code_for_reason
from tokensvc.cli.main import build_parser
from tokensvc.errors import Reason
from tokensvc.v1 import admin_pb2, capability_pb2, data_subject_pb2, knowledge_pb2, memory_pb2, migration_pb2

ROOT = Path(__file__).resolve().parent.parent
API_DOC = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
PROTO_MODULES = (capability_pb2, memory_pb2, knowledge_pb2, admin_pb2, migration_pb2, data_subject_pb2)


def _headings(text: str) -> set[str]:
    return {line.lstrip("#").strip().strip("`") for line in text.splitlines() if re.match(r"#{2,4} ", line)}


def _tokensvc_rpcs() -> list[str]:
    names = [
        f"{service.name}.{method.name}"
        for module in PROTO_MODULES
        for service in module.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    ]
    assert len(names) >= 24, "the generated descriptors lost services"
    return names


def test_every_tokensvc_service_has_a_section() -> None:
    services = [s.name for m in PROTO_MODULES for s in m.DESCRIPTOR.services_by_name.values()]
    missing = [name for name in services if name not in _headings(API_DOC)]
    assert not missing, f"docs/api.md has no section for {missing}"


@pytest.mark.parametrize("rpc", _tokensvc_rpcs())
def test_every_rpc_has_a_heading(rpc: str) -> None:
    assert rpc in _headings(API_DOC), f"docs/api.md has no heading `### {rpc}`"


def test_health_rpcs_have_headings() -> None:
    service = health_pb2.DESCRIPTOR.services_by_name["Health"]
    headings = _headings(API_DOC)
    assert service.full_name in headings
    missing = [m.name for m in service.methods if f"{service.name}.{m.name}" not in headings]
    assert not missing, f"docs/api.md has no heading for Health.{missing}"


def _error_table() -> dict[str, str]:
    """First two cells of the rows of the reason table: reason -> status cell."""
    section = API_DOC.split("### Reasons and status codes", 1)[1].split("\n#", 1)[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and re.fullmatch(r"`[A-Z_]+`", cells[0]):
            reason = cells[0].strip("`")
            assert reason not in rows, f"{reason} appears twice in the error table"
            rows[reason] = cells[1]
    return rows


@pytest.mark.parametrize("reason", list(Reason))
def test_error_table_gives_each_reason_its_status_code(reason: Reason) -> None:
    code = status_code_for_reason(reason)
    rows = _error_table()
    assert reason.value in rows, f"docs/api.md's error table has no row for {reason.value}"
    assert rows[reason.value] == f"`{code.name}` ({code.value[0]})", (
        f"{reason.value} is sent with {code.name} ({code.value[0]}), the table says {rows[reason.value]}"
    )


def test_error_table_has_no_reason_the_code_does_not_know() -> None:
    unknown = set(_error_table()) - {reason.value for reason in Reason}
    assert not unknown, f"docs/api.md's error table lists reasons tokensvc does not have: {unknown}"


def _shell_commands(text: str) -> list[str]:
    """Every `tokensvc ...` invocation inside the page's sh code blocks, continuation lines joined."""
    commands: list[str] = []
    for block in re.findall(r"```sh\n(.*?)```", text, flags=re.DOTALL):
        for raw_line in block.replace("\\\n", " ").splitlines():
            code = raw_line.split(" # ", 1)[0]
            for segment in re.split(r"\$\(|\||&&|;", code):
                match = re.match(r"(?:\.venv/bin/)?tokensvc (.*)", segment.strip().rstrip(")").strip())
                if match:
                    commands.append(match[1])
    return commands


def test_the_page_shows_cli_commands() -> None:
    assert len(_shell_commands(API_DOC)) >= 20


@pytest.mark.parametrize("command", _shell_commands(API_DOC))
def test_every_cli_command_shown_parses(command: str) -> None:
    parser = build_parser()
    try:
        parser.parse_args(shlex.split(command))
    except SystemExit as exc:  # argparse reports bad flags by exiting
        pytest.fail(f"`tokensvc {command}` does not parse (exit {exc.code})")


def test_operations_troubleshooting_has_an_entry_per_reason() -> None:
    operations = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    section = operations.split("## Troubleshooting by error reason", 1)[1]
    entries = re.findall(r"^### `([A-Z_]+)`$", section, flags=re.MULTILINE)
    assert sorted(entries) == sorted(reason.value for reason in Reason), (
        "docs/operations.md needs exactly one troubleshooting entry per error reason"
    )
