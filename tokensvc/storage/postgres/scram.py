"""SCRAM-SHA-256 password verifiers, computed here so no plaintext password reaches PostgreSQL.

`ALTER ROLE ... PASSWORD 'SCRAM-SHA-256$...'` stores the verifier as given; the server (and its
statement log) never sees the password itself. Format: RFC 5803 as PostgreSQL writes it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

__all__ = ["scram_sha256_verifier"]

_ITERATIONS = 4096  # PostgreSQL's default scram_iterations


def scram_sha256_verifier(password: str, *, salt: bytes | None = None, iterations: int = _ITERATIONS) -> str:
    """The verifier PostgreSQL stores for `password`: salted, iterated, one-way."""
    salt = salt if salt is not None else secrets.token_bytes(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode("utf-8"), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", hashlib.sha256).digest()
    stored_key = hashlib.sha256(client_key).digest()
    server_key = hmac.new(salted, b"Server Key", hashlib.sha256).digest()

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode("ascii")

    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(stored_key)}:{b64(server_key)}"
