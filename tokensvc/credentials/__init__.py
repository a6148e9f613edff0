"""Database credential custody: secret sources and SCRAM verifiers.

The rotation machinery lives in `tokensvc.credentials.custody` and `.journal`; they are not
re-exported here because they depend on the audit trail and storage, which import this package.
"""

from tokensvc.credentials.scram import generate_password, scram_sha256_verifier
from tokensvc.credentials.source import DatabaseCredential, FileCredentialSource, write_secret_file

__all__ = [
    "DatabaseCredential",
    "FileCredentialSource",
    "generate_password",
    "scram_sha256_verifier",
    "write_secret_file",
]
