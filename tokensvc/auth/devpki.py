"""Development PKI and key material that `tokensvc dev` creates on first run.

Everything lives under one state directory: a dev CA, a server certificate for localhost, client
certificates for the launcher, admin and control-plane roles (identity is the single SPIFFE URI
SAN; the common name is deliberately different because it is never trusted), an Ed25519 signing
key with its public trust bundle (JWK functions in `tokensvc.auth.keys`, re-exported here), and a
bucket pepper. Creation is idempotent and never overwrites a file: each file is written once,
atomically, with its final permissions from the first byte.
"""

from __future__ import annotations

import base64
import datetime as dt
import errno
import ipaddress
import json
import os
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tokensvc.auth.keys import b64url, jwk_thumbprint, load_signing_key, public_jwk

__all__ = [
    "ADMIN_SPIFFE_ID",
    "CONTROL_PLANE_SPIFFE_ID",
    "DEV_CLIENT_SPIFFE_IDS",
    "DEV_TRUST_DOMAIN",
    "LAUNCHER_SPIFFE_ID",
    "SERVER_SPIFFE_ID",
    "DevMaterialError",
    "DevPaths",
    "ensure_dev_material",
    "issue_client_certificate",
    "jwk_thumbprint",
    "load_signing_key",
    "make_ca",
    "make_certificate",
    "pem_cert",
    "pem_key",
    "public_jwk",
    "spiffe_ids_of",
    "validate_spiffe_id",
]

DEV_TRUST_DOMAIN = "dev.local"
LAUNCHER_SPIFFE_ID = "spiffe://dev.local/ns/default/sa/dev-agent"
ADMIN_SPIFFE_ID = "spiffe://dev.local/admin/platform-admin"
CONTROL_PLANE_SPIFFE_ID = "spiffe://dev.local/ctxmesh/control-plane"
SERVER_SPIFFE_ID = "spiffe://dev.local/tokensvc"

# Client certificate file stem -> the SPIFFE ID it carries.
DEV_CLIENT_SPIFFE_IDS: Mapping[str, str] = MappingProxyType(
    {
        "launcher": LAUNCHER_SPIFFE_ID,
        "admin": ADMIN_SPIFFE_ID,
        "control-plane": CONTROL_PLANE_SPIFFE_ID,
    }
)

_PRIVATE_MODE = 0o600
_PUBLIC_MODE = 0o644
_DIR_MODE = 0o700
_CA_DAYS = 3650
_LEAF_DAYS = 365
_CLOCK_SKEW = dt.timedelta(minutes=5)
_PEPPER_VERSION = "v1"
_SPIFFE_PREFIX = "spiffe://"
_SPIFFE_MAX_BYTES = 2048  # SPIFFE ID spec limit
_TRUST_DOMAIN = re.compile(r"[a-z0-9._-]+")
_PATH_SEGMENT = re.compile(r"[A-Za-z0-9._-]+")
_FILE_STEM = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# errnos meaning "this filesystem has no hard links"; we then fall back to os.replace.
_NO_HARDLINKS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV})


class DevMaterialError(RuntimeError):
    """Existing dev material is inconsistent (half deleted, expired, or from another CA)."""


@dataclass(frozen=True)
class DevPaths:
    """Where each piece of dev material lives under a state directory."""

    state_dir: Path
    pki_dir: Path
    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    signing_key: Path
    trust_bundle: Path
    pepper_dir: Path

    @classmethod
    def for_state_dir(cls, state_dir: Path) -> DevPaths:
        pki, keys = state_dir / "pki", state_dir / "keys"
        return cls(
            state_dir=state_dir,
            pki_dir=pki,
            ca_cert=pki / "ca.crt",
            ca_key=pki / "ca.key",
            server_cert=pki / "server.crt",
            server_key=pki / "server.key",
            signing_key=keys / "signing-key.jwk",
            trust_bundle=keys / "trust-bundle.jwks",
            pepper_dir=state_dir / "secrets" / "peppers",
        )

    def client(self, name: str) -> tuple[Path, Path]:
        """(certificate, key) of a dev client: `launcher`, `admin` or `control-plane`."""
        if name not in DEV_CLIENT_SPIFFE_IDS:
            known = ", ".join(DEV_CLIENT_SPIFFE_IDS)
            raise ValueError(f"unknown dev client {name!r}; expected one of: {known}")
        return self.pki_dir / f"{name}.crt", self.pki_dir / f"{name}.key"

    def private_dirs(self) -> tuple[Path, ...]:
        """The directories this module owns and keeps at mode 0700."""
        return (
            self.pki_dir,
            self.signing_key.parent,
            self.pepper_dir.parent,
            self.pepper_dir,
        )


# --- certificates ---------------------------------------------------------------------------


def pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def pem_key(key: PrivateKeyTypes) -> bytes:
    """PKCS8 PEM, unencrypted: the file mode protects it, as gRPC cannot prompt for a password."""
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def make_ca(
    common_name: str, *, key: ec.EllipticCurvePrivateKey | None = None, days: int = _CA_DAYS
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A self-signed root that may sign leaves only (path_length=0)."""
    key = key or ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    builder = (
        _validity(x509.CertificateBuilder(), days)
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(ca=True), critical=True)
        .add_extension(ski, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
    )
    return builder.sign(key, hashes.SHA256()), key


def make_certificate(
    *,
    issuer_cert: x509.Certificate,
    issuer_key: ec.EllipticCurvePrivateKey,
    subject_cn: str,
    uri_sans: Sequence[str] = (),
    dns_sans: Sequence[str] = (),
    ip_sans: Sequence[str] = (),
    is_ca: bool = False,
    server: bool = False,
    client: bool = False,
    days: int = _LEAF_DAYS,
    subject_key: ec.EllipticCurvePrivateKey | None = None,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """Sign a certificate; no validation, so tests can build deliberately odd ones.

    `subject_key` reuses an existing key (re-issuing a deleted certificate); default is a new one.
    """
    key = subject_key or ec.generate_private_key(ec.SECP256R1())
    builder = (
        _validity(x509.CertificateBuilder(), days)
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject_cn)]))
        .issuer_name(issuer_cert.subject)
        .public_key(key.public_key())
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=0 if is_ca else None), critical=True)
        .add_extension(_key_usage(ca=is_ca), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(_authority_key_id(issuer_cert), critical=False)
    )
    sans = _general_names(uri_sans, dns_sans, ip_sans)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    usages = [ExtendedKeyUsageOID.SERVER_AUTH] * server + [ExtendedKeyUsageOID.CLIENT_AUTH] * client
    if usages:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    return builder.sign(issuer_key, hashes.SHA256()), key


def spiffe_ids_of(cert: x509.Certificate) -> list[str]:
    """The certificate's `spiffe://` URI SANs (callers require exactly one)."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [
        uri
        for uri in san.get_values_for_type(x509.UniformResourceIdentifier)
        if uri.startswith(_SPIFFE_PREFIX)
    ]


def validate_spiffe_id(spiffe_id: str) -> None:
    """Raise ValueError with a readable message unless `spiffe_id` is a valid SPIFFE ID."""
    if len(spiffe_id.encode()) > _SPIFFE_MAX_BYTES:
        raise ValueError(f"SPIFFE ID is longer than {_SPIFFE_MAX_BYTES} bytes")
    if not spiffe_id.startswith(_SPIFFE_PREFIX):
        raise ValueError(f"SPIFFE ID must start with 'spiffe://', got {spiffe_id!r}")
    trust_domain, has_path, path = spiffe_id.removeprefix(_SPIFFE_PREFIX).partition("/")
    if not trust_domain:
        raise ValueError(
            f"SPIFFE ID {spiffe_id!r} has no trust domain; expected spiffe://<trust-domain>/<path>"
        )
    if not _TRUST_DOMAIN.fullmatch(trust_domain):
        raise ValueError(
            f"SPIFFE ID {spiffe_id!r} has an invalid trust domain {trust_domain!r}; "
            "use lowercase letters, digits, '.', '-' and '_'"
        )
    if has_path and not all(_valid_segment(segment) for segment in path.split("/")):
        raise ValueError(
            f"SPIFFE ID {spiffe_id!r} has an invalid path; segments must be non-empty, "
            "not '.' or '..', and use letters, digits, '.', '-' and '_'"
        )


def _valid_segment(segment: str) -> bool:
    return segment not in {".", ".."} and _PATH_SEGMENT.fullmatch(segment) is not None


def issue_client_certificate(
    paths: DevPaths, spiffe_id: str, out_dir: Path, name: str = "client"
) -> tuple[Path, Path]:
    """Sign a client certificate for `spiffe_id` with the dev CA; returns (cert, key) paths.

    Refuses to overwrite an existing certificate or key (FileExistsError).
    """
    validate_spiffe_id(spiffe_id)
    if not _FILE_STEM.fullmatch(name):
        raise ValueError(f"client name {name!r} must be a plain file name (letters, digits, ._-)")
    ca_cert = x509.load_pem_x509_certificate(paths.ca_cert.read_bytes())
    ca_key = _load_ec_key(paths.ca_key)
    cert, key = _client_cert(ca_cert, ca_key, name, spiffe_id)
    cert_path, key_path = out_dir / f"{name}.crt", out_dir / f"{name}.key"
    for path in (cert_path, key_path):
        if path.exists():
            raise FileExistsError(f"{path} already exists; remove it or choose another name")
    out_dir.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
    for path, data, mode in (
        (key_path, pem_key(key), _PRIVATE_MODE),
        (cert_path, pem_cert(cert), _PUBLIC_MODE),
    ):
        if not _publish_new(path, data, mode):
            raise FileExistsError(f"{path} appeared while issuing; remove it and retry")
    return cert_path, key_path


def _validity(builder: x509.CertificateBuilder, days: int) -> x509.CertificateBuilder:
    # Backdated so a peer whose clock is a little behind still accepts a fresh certificate.
    now = dt.datetime.now(dt.UTC)
    return (
        builder.serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(now + dt.timedelta(days=days))
    )


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not ca,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def _authority_key_id(issuer_cert: x509.Certificate) -> x509.AuthorityKeyIdentifier:
    try:
        ski = issuer_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    except x509.ExtensionNotFound:
        return x509.AuthorityKeyIdentifier.from_issuer_public_key(
            issuer_cert.public_key()  # type: ignore[arg-type]
        )
    return x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski)


def _general_names(uris: Sequence[str], dns: Sequence[str], ips: Sequence[str]) -> list[x509.GeneralName]:
    return [
        *(x509.UniformResourceIdentifier(uri) for uri in uris),
        *(x509.DNSName(name) for name in dns),
        *(x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips),
    ]


def _server_cert(
    ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, key: ec.EllipticCurvePrivateKey
) -> x509.Certificate:
    cert, _ = make_certificate(
        issuer_cert=ca_cert,
        issuer_key=ca_key,
        subject_cn="tokensvc dev server",
        uri_sans=[SERVER_SPIFFE_ID],
        dns_sans=["localhost"],
        ip_sans=["127.0.0.1", "::1"],
        server=True,
        subject_key=key,
    )
    return cert


def _client_cert(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    name: str,
    spiffe_id: str,
    key: ec.EllipticCurvePrivateKey | None = None,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    # The CN is a human label that is deliberately not the SPIFFE ID: identity is the URI SAN.
    return make_certificate(
        issuer_cert=ca_cert,
        issuer_key=ca_key,
        subject_cn=f"tokensvc dev client {name}",
        uri_sans=[spiffe_id],
        client=True,
        subject_key=key,
    )


# --- signing key, trust bundle ----------------------------------------------------------------


def _signing_jwk_bytes() -> bytes:
    key = Ed25519PrivateKey.generate()
    jwk = public_jwk(key.public_key(), jwk_thumbprint(key.public_key()))
    raw_private = key.private_bytes(
        serialization.Encoding.Raw,
        serialization.PrivateFormat.Raw,
        serialization.NoEncryption(),
    )
    private = {k: jwk[k] for k in ("kty", "crv", "x")} | {"d": b64url(raw_private)}
    return _json_bytes(private | {"kid": jwk["kid"]})


def _json_bytes(value: object) -> bytes:
    return (json.dumps(value, indent=2) + "\n").encode()


# --- ensure -----------------------------------------------------------------------------------


def ensure_dev_material(state_dir: Path) -> DevPaths:
    """Create whatever dev material is missing under `state_dir`; never overwrite a file.

    Raises DevMaterialError when what exists is inconsistent (e.g. a certificate not issued by
    the current CA), naming the file to delete.
    """
    paths = DevPaths.for_state_dir(state_dir)
    state_dir.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
    for directory in paths.private_dirs():
        directory.mkdir(mode=_DIR_MODE, exist_ok=True)
        directory.chmod(_DIR_MODE)
    ca_cert, ca_key = _ensure_pair(
        paths.ca_cert, paths.ca_key, None, lambda key: make_ca("tokensvc dev CA", key=key)[0]
    )
    _ensure_pair(paths.server_cert, paths.server_key, ca_cert, lambda key: _server_cert(ca_cert, ca_key, key))
    for name, spiffe_id in DEV_CLIENT_SPIFFE_IDS.items():
        _ensure_client(paths, name, spiffe_id, ca_cert, ca_key)
    _ensure_signing_material(paths)
    _create_or_read(
        paths.pepper_dir / _PEPPER_VERSION,
        lambda: base64.urlsafe_b64encode(secrets.token_bytes(32)),
        _PRIVATE_MODE,
    )
    return paths


def _ensure_client(
    paths: DevPaths,
    name: str,
    spiffe_id: str,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
) -> None:
    cert_path, key_path = paths.client(name)
    _ensure_pair(
        cert_path,
        key_path,
        ca_cert,
        lambda key: _client_cert(ca_cert, ca_key, name, spiffe_id, key)[0],
    )


def _ensure_pair(
    cert_path: Path,
    key_path: Path,
    issuer: x509.Certificate | None,
    issue: Callable[[ec.EllipticCurvePrivateKey], x509.Certificate],
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """Key first, then a certificate for it; `issuer` None means self-signed."""
    if cert_path.exists() and not key_path.exists():
        raise DevMaterialError(
            f"{cert_path} exists but its key {key_path} is missing; delete {cert_path} to reissue"
        )
    _create_or_read(key_path, lambda: pem_key(ec.generate_private_key(ec.SECP256R1())), _PRIVATE_MODE)
    key = _load_ec_key(key_path)
    cert_pem = _create_or_read(cert_path, lambda: pem_cert(issue(key)), _PUBLIC_MODE)
    cert = x509.load_pem_x509_certificate(cert_pem)
    _check_cert(cert_path, cert, key, issuer or cert)
    return cert, key


def _check_cert(
    path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey, issuer: x509.Certificate
) -> None:
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if cert.public_key().public_bytes(*spki) != key.public_key().public_bytes(*spki):
        raise DevMaterialError(f"{path} does not match its key; delete {path} to reissue")
    try:
        cert.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature) as exc:
        raise DevMaterialError(
            f"{path} was not issued by the current dev CA; delete {path.parent} to start over"
        ) from exc
    if cert.not_valid_after_utc <= dt.datetime.now(dt.UTC):
        raise DevMaterialError(f"{path} has expired; delete {path.parent} to start over")


def _ensure_signing_material(paths: DevPaths) -> None:
    _create_or_read(paths.signing_key, _signing_jwk_bytes, _PRIVATE_MODE)
    kid, key = load_signing_key(paths.signing_key)
    bundle = {"keys": [public_jwk(key.public_key(), kid)]}
    existing = _create_or_read(paths.trust_bundle, lambda: _json_bytes(bundle), _PUBLIC_MODE)
    if kid not in _bundle_kids(existing):
        raise DevMaterialError(
            f"{paths.trust_bundle} does not list the signing key {kid!r}; "
            f"delete {paths.trust_bundle} to rebuild it"
        )


def _bundle_kids(data: bytes) -> list[object]:
    try:
        bundle = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return []
    keys = bundle.get("keys") if isinstance(bundle, dict) else None
    return [key.get("kid") for key in keys or [] if isinstance(key, dict)]


def _load_ec_key(path: Path) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (ValueError, TypeError) as exc:
        raise DevMaterialError(f"{path} is not an unencrypted PEM private key") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise DevMaterialError(f"{path} is not an EC private key")
    return key


# --- files ------------------------------------------------------------------------------------


def _create_or_read(path: Path, make: Callable[[], bytes], mode: int) -> bytes:
    """The file's bytes, creating it from `make()` if missing; a concurrent creator wins."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        pass
    data = make()
    return data if _publish_new(path, data, mode) else path.read_bytes()


def _publish_new(path: Path, data: bytes, mode: int) -> bool:
    """Atomically create `path` with `data`; False (nothing written) if it already exists.

    The temp file is created with `mode` so a secret is never readable by others, fsynced, then
    hard-linked into place: unlike os.replace, a link never clobbers a file created meanwhile.
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), mode)  # exact mode whatever the umask
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        created = _link_no_clobber(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)
    return created


def _link_no_clobber(tmp: Path, path: Path) -> bool:
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in _NO_HARDLINKS:
            raise
        if path.exists():
            return False
        os.replace(tmp, path)  # no hard links here: fall back to a plain atomic rename
    return True


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
