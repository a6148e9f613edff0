"""Validation patterns are matched whole: a trailing newline never passes as part of a name.

`re.match` with a pattern ending in `$` accepts `"name\\n"` (`$` matches before a final newline);
tokensvc validates with `fullmatch` (tokensvc/names.py holds the shared formats). The structural
check below fails when a pattern anchored with `$` comes back.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tokensvc.auth.identity import IdentityPolicy, parse_spiffe_id
from tokensvc.embedders import load_embedders
from tokensvc.names import is_dns_label, is_kb_ref, is_sql_identifier
from tokensvc.settings import SettingsError
from tokensvc.settings_sources import load_settings
from tokensvc.storage.postgres.schema_migrations import apply_schema_migrations
from tokensvc.storage.records import Tenant

PACKAGE = Path(__file__).resolve().parent.parent / "tokensvc"
# Patterns that parse text rather than validate input: `$` there means end of line, on purpose.
PARSERS = {"knowledge/chunking.py": "markdown line syntax (ATX headings, code fences)"}


def test_no_pattern_in_the_package_is_anchored_with_a_dollar() -> None:
    anchored = []
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE)
        if "v1" in relative.parts or relative.as_posix() in PARSERS:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "compile"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
                and node.args[0].value.endswith("$")
            ):
                anchored.append(f"{relative}:{node.lineno}")
    assert not anchored, f"use fullmatch instead of a `$` anchor: {anchored}"


@pytest.mark.parametrize("check", [is_dns_label, is_kb_ref, is_sql_identifier])
def test_shared_name_formats_refuse_a_trailing_newline(check: object) -> None:
    assert callable(check)
    assert check("default")
    assert not check("default\n")
    assert not check("default\r\n")


def test_a_spiffe_id_with_a_trailing_newline_is_not_one_nor_a_launcher() -> None:
    with pytest.raises(ValueError, match="SPIFFE"):
        parse_spiffe_id("spiffe://dev.local/ns/default/sa/agent\n")
    policy = IdentityPolicy(
        trust_domain="dev.local",
        launcher_template="spiffe://{trust_domain}/ns/{namespace}/sa/{agent}",
        admin_ids=[],
        control_plane_ids=[],
    )
    caller = policy.caller("spiffe://dev.local/ns/default/sa/agent\n", b"\0" * 32)
    assert caller.roles == frozenset()


def test_a_tenant_refuses_a_bucket_or_ref_with_a_trailing_newline() -> None:
    with pytest.raises(ValueError, match="bucket"):
        Tenant("default", "agent", ("v1.abcdefgh\n",))
    with pytest.raises(ValueError, match="knowledge base"):
        Tenant("default", knowledge_bases=("kb\n",))


def test_settings_refuse_identifiers_and_trust_domains_with_a_trailing_newline() -> None:
    for name, value in (
        ("database_app_role", "tokensvc_app\n"),
        ("trust_domain", "dev.local\n"),
        ("database_login_roles", ["a_role", "b_role\n"]),
        ("database_runner_login_roles", ["a_role", "b_role\n"]),
        # The runner's login roles are never the serving ones (ROTATE of one would take the other's).
        ("database_runner_login_roles", ["tokensvc_app_a", "tokensvc_runner_b"]),
    ):
        with pytest.raises(SettingsError, match=name):
            load_settings(environ={}, overrides={name: value})


def test_an_embedder_name_with_a_trailing_newline_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "embedders.toml"
    config.write_text('[embedders."small\\n"]\nkind = "hash"\n')
    with pytest.raises(SettingsError, match="a name is lower-case"):
        load_embedders(config)


async def test_migrations_refuse_an_app_role_with_a_trailing_newline() -> None:
    from tokensvc.storage.postgres import SchemaMigrationError

    with pytest.raises(SchemaMigrationError, match="plain SQL identifier"):
        await apply_schema_migrations(None, app_role="tokensvc_app\n")  # type: ignore[arg-type]
