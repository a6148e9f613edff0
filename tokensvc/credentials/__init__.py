"""Database credential custody: zero-downtime RELOAD and ROTATE, journaled, crash-recoverable.

The custodian takes storage ports (`tokensvc.storage.ports`); the secret-file source and the
credential record it reads live in storage (`tokensvc.storage.secrets`, `.records`) and are
re-exported here for callers of this package.
"""

from tokensvc.credentials.custody import CredentialCustodian, CredentialStatus, RotationMode
from tokensvc.storage.records import DatabaseCredential
from tokensvc.storage.secrets import FileCredentialSource, generate_password, write_secret_file

__all__ = [
    "CredentialCustodian",
    "CredentialStatus",
    "DatabaseCredential",
    "FileCredentialSource",
    "RotationMode",
    "generate_password",
    "write_secret_file",
]
