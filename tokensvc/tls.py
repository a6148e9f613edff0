"""Server TLS material that reloads from its files without a restart.

gRPC asks `fetch()` before each new handshake (on its own thread, so it must be cheap and never
block): we stat the three files at most once a second and, only when one changed, read and check
them. A malformed or half-written set (unparsable PEM, a key that does not match the
certificate, an empty CA bundle) keeps the configuration in force and logs an error once per
change. Existing connections keep the certificate they were made with; `max_connection_age`
bounds how long that is.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

__all__ = ["ReloadingServerCredentials", "TlsMaterialError"]

_log = logging.getLogger(__name__)


class TlsMaterialError(ValueError):
    """The certificate, key or CA bundle cannot be used; the message names the file."""


def _stamp(paths: tuple[Path, ...]) -> tuple[tuple[int, int, int], ...]:
    stamps = []
    for path in paths:
        try:
            stat = path.stat()
            stamps.append((stat.st_ino, stat.st_size, stat.st_mtime_ns))
        except OSError:
            stamps.append((-1, -1, -1))
    return tuple(stamps)


def load_material(cert_file: Path, key_file: Path, ca_file: Path) -> tuple[bytes, bytes, bytes]:
    """Read and check the set; raises TlsMaterialError naming what is wrong."""
    try:
        cert_pem, key_pem, ca_pem = cert_file.read_bytes(), key_file.read_bytes(), ca_file.read_bytes()
    except OSError as exc:
        raise TlsMaterialError(f"{exc.filename}: cannot be read ({exc.strerror})") from None
    try:
        leaf = x509.load_pem_x509_certificates(cert_pem)[0]
    except ValueError:
        raise TlsMaterialError(f"{cert_file}: not a PEM certificate chain") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError):
        raise TlsMaterialError(f"{key_file}: not an unencrypted PEM private key") from None
    if key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    ) != leaf.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    ):
        raise TlsMaterialError(f"{key_file}: does not match the certificate in {cert_file}")
    try:
        if not x509.load_pem_x509_certificates(ca_pem):
            raise ValueError
    except ValueError:
        raise TlsMaterialError(f"{ca_file}: not a PEM CA bundle") from None
    return cert_pem, key_pem, ca_pem


class ReloadingServerCredentials:
    def __init__(
        self,
        cert_file: Path,
        key_file: Path,
        ca_file: Path,
        *,
        check_interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._paths = (cert_file, key_file, ca_file)
        self._interval = check_interval
        self._clock = clock
        self._lock = threading.Lock()
        self._material = load_material(*self._paths)
        self._stamp = _stamp(self._paths)
        self._next_check = clock() + check_interval
        self.reloads = 0

    def credentials(self) -> grpc.ServerCredentials:
        # grpc-stubs types the fetcher as never returning None; gRPC documents None as "no change".
        fetcher: Callable[[], Any] = self.fetch
        return grpc.dynamic_ssl_server_credentials(
            self._configuration(), fetcher, require_client_authentication=True
        )

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        cert_pem, key_pem, ca_pem = self._material
        return grpc.ssl_server_certificate_configuration([(key_pem, cert_pem)], root_certificates=ca_pem)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's per-handshake callback: a new configuration, or None to keep the current one."""
        now = self._clock()
        if now < self._next_check or not self._lock.acquire(blocking=False):
            return None
        try:
            self._next_check = now + self._interval
            stamp = _stamp(self._paths)
            if stamp == self._stamp:
                return None
            self._stamp = stamp
            try:
                self._material = load_material(*self._paths)
            except TlsMaterialError as exc:
                _log.error(
                    "server TLS files changed but are unusable; keeping the previous ones",
                    extra={"error": str(exc)},
                )
                return None
            self.reloads += 1
            _log.info("server TLS certificate reloaded", extra={"reloads": self.reloads})
            return self._configuration()
        finally:
            self._lock.release()
