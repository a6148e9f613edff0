"""Database credential custody: secret sources and password verifiers."""

from tokensvc.credentials.scram import generate_password, scram_sha256_verifier
from tokensvc.credentials.source import DatabaseCredential, FileCredentialSource, write_secret_file

__all__ = [
    "DatabaseCredential",
    "FileCredentialSource",
    "generate_password",
    "scram_sha256_verifier",
    "write_secret_file",
]
