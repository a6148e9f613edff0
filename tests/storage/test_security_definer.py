"""SECURITY DEFINER functions cannot be hijacked through the caller's search_path."""

from __future__ import annotations

import asyncpg

from tests.support import SharedDatabase
from tokensvc.credentials import FileCredentialSource


async def test_every_security_definer_function_pins_pg_catalog_first_and_pg_temp_last(
    database: SharedDatabase,
) -> None:
    credential = FileCredentialSource(database.superuser_credential_dir).read()
    conn = await asyncpg.connect(database.dsn, user=credential.username, password=credential.password)
    try:
        rows = await conn.fetch(
            "SELECT p.proname, p.proconfig FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
            "WHERE n.nspname = 'tokensvc' AND p.prosecdef"
        )
    finally:
        await conn.close()
    assert len(rows) >= 5
    for name, config in rows:
        paths = [item.split("=", 1)[1] for item in config or [] if item.startswith("search_path=")]
        assert paths, f"{name} has no fixed search_path"
        parts = [part.strip() for part in paths[0].split(",")]
        assert parts[0] == "pg_catalog", name
        assert parts[-1] == "pg_temp", name
