"""A Citus coordinator's database made ready for tokensvc, for the Citus tests and bench: the
roles `tokensvc.storage.postgres.embedded.ensure_roles` makes, the schema owner owning the
database, CONNECT for the serving and runner groups and the rotator only, and pgvector. (The
embedded server does the same for itself; a production database is prepared by its DBA:
docs/operations.md, "Database roles".)"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import asyncpg

from tokensvc.credentials import DatabaseCredential, FileCredentialSource
from tokensvc.storage.postgres import EmbeddedPaths, EmbeddedPostgresError, citus_version, ensure_roles
from tokensvc.storage.postgres.embedded import APP_GROUP_ROLE, OWNER_ROLE, ROTATOR_ROLE, RUNNER_GROUP_ROLE

__all__ = ["prepare_citus_database"]


async def prepare_citus_database(superuser_dsn: str, paths: EmbeddedPaths) -> str:
    """Prepare the Citus coordinator's database a superuser DSN (with its password) names, the
    credentials kept under `paths`; returns the credential-free DSN tokensvc is configured with."""
    parts = urlsplit(superuser_dsn)
    if not (parts.hostname and parts.username and parts.password and parts.path.strip("/")):
        raise EmbeddedPostgresError("needs postgresql://SUPERUSER:PASSWORD@HOST:PORT/DATABASE")
    FileCredentialSource(paths.credential_dir("superuser")).write(
        DatabaseCredential(parts.username, parts.password)
    )
    conn = await asyncpg.connect(superuser_dsn)
    try:
        if await citus_version(conn) is None:
            raise EmbeddedPostgresError(f"database {parts.path.strip('/')!r} has no citus extension")
        await _prepare(conn, paths)
    finally:
        await conn.close()
    return urlunsplit(("postgresql", f"{parts.hostname}:{parts.port or 5432}", parts.path, "", ""))


async def _prepare(conn: asyncpg.Connection, paths: EmbeddedPaths) -> None:
    name = await conn.fetchval("SELECT current_database()")
    await ensure_roles(conn, paths)
    quoted = '"' + str(name).replace('"', '""') + '"'
    await conn.execute(f"ALTER DATABASE {quoted} OWNER TO {OWNER_ROLE}")
    await conn.execute(f"REVOKE ALL ON DATABASE {quoted} FROM PUBLIC")
    await conn.execute(
        f"GRANT CONNECT ON DATABASE {quoted} TO {APP_GROUP_ROLE}, {RUNNER_GROUP_ROLE}, {ROTATOR_ROLE}"
    )
    await conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
