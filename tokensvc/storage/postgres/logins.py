"""Login roles in PostgreSQL: `tokensvc.storage.ports.DatabaseLogins`, for credential custody.

Each operation uses a connection of its own, outside the serving pool (a login test must try the
credential itself; a password change runs as the rotator; the rotation lock lives as long as its
session). Passwords are sent as SCRAM verifiers only (`scram.py`), so neither the server nor its
statement log ever sees one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg

from tokensvc.errors import DatabaseRefused, DatabaseUnavailable, Reason, TokensvcError
from tokensvc.names import is_sql_identifier
from tokensvc.storage.postgres.database import DatabaseTarget, connect_once
from tokensvc.storage.postgres.errors import database_errors, domain_error
from tokensvc.storage.postgres.scram import scram_sha256_verifier
from tokensvc.storage.records import DatabaseCredential

__all__ = ["ROTATION_LOCK", "PostgresLogins"]

# Every replica agrees on this lock id: one rotation at a time across the whole deployment.
ROTATION_LOCK = 0x746F6B656E726F74  # "tokenrot"


class PostgresLogins:
    def __init__(self, target: DatabaseTarget):
        self._target = target

    async def _connect(self, credential: DatabaseCredential) -> asyncpg.Connection:
        try:
            return await connect_once(self._target, credential)
        except (asyncpg.InvalidPasswordError, asyncpg.InvalidAuthorizationSpecificationError):
            raise TokensvcError(
                f"the credential for role {credential.username!r} does not log in",
                reason=Reason.CREDENTIAL_INVALID,
            ) from None
        except (OSError, TimeoutError, asyncpg.PostgresConnectionError, asyncpg.CannotConnectNowError):
            raise DatabaseUnavailable() from None

    async def test_login(self, credential: DatabaseCredential) -> None:
        conn = await self._connect(credential)
        try:
            with database_errors():
                await conn.fetchval("SELECT 1")
        finally:
            await conn.close()

    async def set_password(self, role: str, password: str | None, *, admin: DatabaseCredential) -> None:
        if not is_sql_identifier(role):
            raise ValueError(f"role {role!r} is not a plain SQL identifier")
        conn = await self._connect(admin)
        try:
            # A verifier is base64 and '$' only; NULL removes password login altogether.
            value = "NULL" if password is None else f"'{scram_sha256_verifier(password)}'"
            try:
                await conn.execute(f'ALTER ROLE "{role}" PASSWORD {value}')
            except Exception as exc:
                translated = domain_error(exc)
                if translated is not None:
                    raise translated from exc
                if isinstance(exc, asyncpg.PostgresError):
                    raise DatabaseRefused(type(exc).__name__) from None
                raise
        finally:
            await conn.close()

    @asynccontextmanager
    async def rotation_lock(self, credential: DatabaseCredential) -> AsyncIterator[bool]:
        conn = await self._connect(credential)
        try:
            with database_errors():
                held = bool(await conn.fetchval("SELECT pg_try_advisory_lock($1)", ROTATION_LOCK))
            yield held
        finally:
            await conn.close()  # ends the session, releasing the lock
