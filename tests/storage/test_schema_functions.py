"""SQL functions live in `functions/*.sql`, one file per family, applied after the numbered files.

The switch from function bodies inside numbered migrations to one file per family must change
nothing a database holds: a database migrated by the tree before the switch (kept, frozen, in
`fixtures/migrations_before_functions.tar.gz`), one migrated by today's tree, and one upgraded
from the first to the second end with the same functions (`pg_get_functiondef`, owner, grants),
triggers, policies, tables, columns, indexes, constraints and privileges.
"""

from __future__ import annotations

import hashlib
import re
import tarfile
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from tests.storage.migration_support import (
    APP_ROLE,
    RUNNER_ROLE,
    before_the_switch,
    connect,
    migrate_with_the_tree_before_the_switch,
    scratch_database,
)
from tests.support import SharedDatabase
from tokensvc.storage.postgres import schema_migrations
from tokensvc.storage.postgres.schema_migrations import (
    LEGACY_CHECKSUMS,
    SchemaFunctions,
    SchemaMigrationError,
    apply_schema_migrations,
    available_schema_functions,
    available_schema_migrations,
)

# The function files' own bookkeeping, which the tree before the switch did not have.
SWITCH_BOOKKEEPING = "schema_functions%"
LAST_BEFORE_THE_SWITCH = 22
FUNCTIONS_AT_THE_SWITCH = Path(__file__).parent / "fixtures" / "functions_at_the_switch.tar.gz"
POLICY_PREDICATES = {"tokensvc.kb_visible"}

# Everything of the tokensvc schema a migration can change, each as sorted text rows.
FINGERPRINT = {
    "functions": """
        SELECT p.oid::regprocedure::text, pg_get_functiondef(p.oid), pg_get_userbyid(p.proowner),
               ARRAY(SELECT a::text FROM unnest(coalesce(p.proacl, '{}')) AS a ORDER BY 1)::text
        FROM pg_proc p WHERE p.pronamespace = 'tokensvc'::regnamespace""",
    "triggers": """
        SELECT t.tgrelid::regclass::text, t.tgname, pg_get_triggerdef(t.oid), t.tgenabled::text
        FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
        WHERE c.relnamespace = 'tokensvc'::regnamespace AND NOT t.tgisinternal""",
    "policies": """
        SELECT tablename, policyname, permissive, roles::text, cmd, qual, with_check
        FROM pg_policies WHERE schemaname = 'tokensvc'""",
    "relations": """
        SELECT c.relname, c.relkind::text, pg_get_userbyid(c.relowner), c.relrowsecurity,
               c.relforcerowsecurity, c.reloptions::text,
               ARRAY(SELECT a::text FROM unnest(coalesce(c.relacl, '{}')) AS a ORDER BY 1)::text
        FROM pg_class c WHERE c.relnamespace = 'tokensvc'::regnamespace AND c.relname NOT LIKE $1""",
    "columns": """
        SELECT c.relname, a.attnum, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
               pg_get_expr(d.adbin, d.adrelid), a.attgenerated::text,
               ARRAY(SELECT x::text FROM unnest(coalesce(a.attacl, '{}')) AS x ORDER BY 1)::text
        FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE c.relnamespace = 'tokensvc'::regnamespace AND a.attnum > 0 AND NOT a.attisdropped
          AND c.relname NOT LIKE $1""",
    "indexes": """
        SELECT tablename, indexname, indexdef FROM pg_indexes
        WHERE schemaname = 'tokensvc' AND tablename NOT LIKE $1""",
    "constraints": """
        SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid)
        FROM pg_constraint WHERE connamespace = 'tokensvc'::regnamespace
          AND conrelid::regclass::text NOT LIKE 'tokensvc.' || $1""",
    "privileges": """
        SELECT 'default', defaclobjtype::text, defaclacl::text FROM pg_default_acl
        WHERE defaclnamespace = 'tokensvc'::regnamespace
        UNION ALL SELECT 'schema', nspname, nspacl::text FROM pg_namespace WHERE nspname = 'tokensvc'""",
}


async def fingerprint(conn: asyncpg.Connection) -> dict[str, list[tuple[Any, ...]]]:
    found = {}
    for name, sql in FINGERPRINT.items():
        arguments = [SWITCH_BOOKKEEPING] if "$1" in sql else []
        found[name] = sorted(tuple(row) for row in await conn.fetch(sql, *arguments))
    return found


def differences(left: dict[str, list[tuple[Any, ...]]], right: dict[str, list[tuple[Any, ...]]]) -> list[str]:
    """What one fingerprint holds and the other does not, readable in a failure."""
    found = []
    for name in FINGERPRINT:
        only_left = set(left[name]) - set(right[name])
        only_right = set(right[name]) - set(left[name])
        found += [f"{name} only before: {row}" for row in sorted(only_left, key=str)]
        found += [f"{name} only after: {row}" for row in sorted(only_right, key=str)]
    return found


async def migrate_as_at_the_switch(conn: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch) -> None:
    """`tokensvc migrate` of the tree right after the switch: today's numbered files up to it (frozen
    since) and the function files as they were then."""
    shipped = available_schema_migrations()
    with monkeypatch.context() as patched:
        patched.setattr(
            schema_migrations,
            "available_schema_migrations",
            lambda: [m for m in shipped if m.version <= LAST_BEFORE_THE_SWITCH],
        )
        patched.setattr(schema_migrations, "available_schema_functions", functions_at_the_switch)
        await apply_schema_migrations(conn, app_role=APP_ROLE, runner_role=RUNNER_ROLE)


def functions_at_the_switch() -> list[SchemaFunctions]:
    with tarfile.open(FUNCTIONS_AT_THE_SWITCH) as archive:
        return [
            SchemaFunctions(member.name.removesuffix(".sql"), archive.extractfile(member).read().decode())  # type: ignore[union-attr]
            for member in sorted(archive.getmembers(), key=lambda m: m.name)
        ]


async def test_the_switch_to_function_files_changes_nothing_a_database_holds(
    database: SharedDatabase, scratch_databases: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    old, new, upgraded = scratch_databases
    prints = {}
    for name in (old, new, upgraded):
        conn = await connect(database, "owner", name)
        try:
            if name in (old, upgraded):
                await migrate_with_the_tree_before_the_switch(conn)
            if name in (new, upgraded):
                await migrate_as_at_the_switch(conn, monkeypatch)
            prints[name] = await fingerprint(conn)
        finally:
            await conn.close()
    assert differences(prints[old], prints[new]) == []
    assert differences(prints[old], prints[upgraded]) == []
    # The test would prove nothing on an empty schema.
    assert len(prints[new]["functions"]) >= 40
    assert len(prints[new]["triggers"]) >= 3


async def test_a_database_of_the_tree_before_the_switch_upgrades_to_what_todays_tree_makes(
    database: SharedDatabase, scratch_databases: list[str]
) -> None:
    fresh, upgraded = scratch_databases[:2]
    prints = {}
    for name in (fresh, upgraded):
        conn = await connect(database, "owner", name)
        try:
            if name == upgraded:
                await migrate_with_the_tree_before_the_switch(conn)
            await apply_schema_migrations(conn, app_role=APP_ROLE, runner_role=RUNNER_ROLE)
            prints[name] = await fingerprint(conn)
        finally:
            await conn.close()
    assert differences(prints[fresh], prints[upgraded]) == []


async def test_an_upgraded_database_records_todays_checksums_and_every_function_file(
    database: SharedDatabase, scratch_databases: list[str]
) -> None:
    name = scratch_databases[0]
    conn = await connect(database, "owner", name)
    try:
        await migrate_with_the_tree_before_the_switch(conn)
        applied = await apply_schema_migrations(conn, app_role=APP_ROLE, runner_role=RUNNER_ROLE)
        assert [item.label for item in applied] == [
            *(m.label for m in available_schema_migrations() if m.version > LAST_BEFORE_THE_SWITCH),
            *(f"functions/{family.name}" for family in available_schema_functions()),
        ]
        recorded = dict(await conn.fetch("SELECT version, checksum FROM tokensvc.schema_migrations"))
        assert recorded == {m.version: m.checksum for m in available_schema_migrations()}
        # Up to date now: a second run has nothing to do.
        assert await apply_schema_migrations(conn, app_role=APP_ROLE, runner_role=RUNNER_ROLE) == []
    finally:
        await conn.close()


def test_the_accepted_checksums_are_those_of_the_files_before_the_switch() -> None:
    before = {
        version: hashlib.sha256(sql.encode("utf-8")).hexdigest() for version, sql in before_the_switch()
    }
    today = {m.version: m.checksum for m in available_schema_migrations()}
    rewritten = {version: checksum for version, checksum in before.items() if today[version] != checksum}
    assert rewritten == LEGACY_CHECKSUMS


def test_no_numbered_migration_holds_a_function_body_and_each_function_has_one_file() -> None:
    # A function is its name and its arguments (expect_knowledge_bases has two).
    creates = re.compile(r"CREATE\s+(?:OR\s+REPLACE\s+)?FUNCTION\s+([\w.]+\s*\([^)]*\))", re.IGNORECASE)
    defined: dict[str, str] = {}
    for migration in available_schema_migrations():
        for function in creates.findall(migration.sql):
            # A predicate of a row-level security policy is part of the policy: it must exist
            # before the policy is created, so it is defined beside it (docs/development.md).
            assert function.split("(")[0] in POLICY_PREDICATES, f"{function} in {migration.label}"
            defined[function] = migration.label
    for family in available_schema_functions():
        for function in creates.findall(family.sql):
            assert function not in defined, f"{function} in {defined.get(function)} and {family.name}"
            defined[function] = family.name
    assert len(defined) >= 40


async def test_a_changed_function_file_is_applied_again_and_an_unchanged_one_is_not(
    database: SharedDatabase, scratch_databases: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    name = scratch_databases[0]
    conn = await connect(database, "owner", name)
    try:
        await apply_schema_migrations(conn, app_role=APP_ROLE, runner_role=RUNNER_ROLE)
        families = available_schema_functions()
        changed = families[0]
        edited = changed.__class__(changed.name, changed.sql + "\n-- a comment changes the checksum\n")
        monkeypatch.setattr(
            schema_migrations,
            "available_schema_functions",
            lambda: [edited if family is changed else family for family in families],
        )
        applied = await apply_schema_migrations(conn, app_role=APP_ROLE, runner_role=RUNNER_ROLE)
        assert [item.label for item in applied] == [f"functions/{changed.name}"]
        history = await conn.fetch(
            "SELECT checksum FROM tokensvc.schema_functions WHERE name = $1 ORDER BY id", changed.name
        )
        assert [row["checksum"] for row in history] == [changed.checksum, edited.checksum]
        # A tokensvc that still ships the file as it was must not put the old bodies back.
        monkeypatch.setattr(schema_migrations, "available_schema_functions", lambda: families)
        with pytest.raises(SchemaMigrationError, match=f"functions/{changed.name}.sql .* newer"):
            await apply_schema_migrations(conn, app_role=APP_ROLE, runner_role=RUNNER_ROLE)
    finally:
        await conn.close()


@pytest.fixture
async def scratch_databases(database: SharedDatabase) -> Any:
    """Three empty databases of the schema owner, with pgvector."""
    async with (
        scratch_database(database) as a,
        scratch_database(database) as b,
        scratch_database(database) as c,
    ):
        yield [a, b, c]
