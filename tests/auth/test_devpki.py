"""The dev PKI: real certificates, real signatures, real file modes and a real mTLS handshake."""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import socket
import ssl
import stat
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import cast

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tokensvc.auth.devpki import (
    ADMIN_SPIFFE_ID,
    CONTROL_PLANE_SPIFFE_ID,
    DEV_CLIENT_SPIFFE_IDS,
    LAUNCHER_SPIFFE_ID,
    SERVER_SPIFFE_ID,
    DevMaterialError,
    DevPaths,
    ensure_dev_material,
    issue_client_certificate,
    jwk_thumbprint,
    load_signing_key,
    make_ca,
    make_certificate,
    pem_cert,
    pem_key,
    spiffe_ids_of,
)

# RFC 8037 appendix A: an Ed25519 key pair and its RFC 7638 thumbprint.
RFC8037_X = "11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"
RFC8037_D = "nWGxne_9WmC6hEr0kuwsxERJxWl7MmkZcDusAxyuf2A"
RFC8037_THUMBPRINT = "kPrK_qmxVWaYVA9wwBF6Iuo3vVzz7TxHCTwXBygrS4k"


@pytest.fixture(scope="module")
def dev(tmp_path_factory: pytest.TempPathFactory) -> DevPaths:
    """Shared material for tests that only read it."""
    return ensure_dev_material(tmp_path_factory.mktemp("state"))


@pytest.fixture
def permissive_umask() -> Iterator[None]:
    # Modes must come from the code, not from a friendly umask.
    previous = os.umask(0)
    try:
        yield
    finally:
        os.umask(previous)


def load_cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def uri_sans(cert: x509.Certificate) -> list[str]:
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return san.get_values_for_type(x509.UniformResourceIdentifier)


def extended_key_usages(cert: x509.Certificate) -> list[x509.ObjectIdentifier]:
    return list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def snapshot(state_dir: Path) -> dict[Path, tuple[int, int, bytes]]:
    return {
        path: (path.stat().st_ino, path.stat().st_mtime_ns, path.read_bytes())
        for path in sorted(state_dir.rglob("*"))
        if path.is_file()
    }


def b64url_decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


# --- certificates ----------------------------------------------------------------------------


def test_ca_is_a_critical_path_length_zero_ca_that_signs_certificates(dev: DevPaths) -> None:
    ca = load_cert(dev.ca_cert)
    constraints = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    usage = ca.extensions.get_extension_for_class(x509.KeyUsage).value

    assert constraints.critical
    assert constraints.value.ca
    assert constraints.value.path_length == 0
    assert usage.key_cert_sign
    assert usage.crl_sign
    ca.verify_directly_issued_by(ca)


def test_server_certificate_verifies_against_ca_and_names_localhost(dev: DevPaths) -> None:
    server = load_cert(dev.server_cert)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value

    server.verify_directly_issued_by(load_cert(dev.ca_cert))
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "::1"}
    assert uri_sans(server) == [SERVER_SPIFFE_ID]
    assert extended_key_usages(server) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert not server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_leaf_is_backdated_five_minutes_and_names_the_ca_key(dev: DevPaths) -> None:
    server, ca = load_cert(dev.server_cert), load_cert(dev.ca_cert)
    authority = server.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    ca_subject_key = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value

    lifetime = server.not_valid_after_utc - server.not_valid_before_utc
    assert lifetime == dt.timedelta(days=365, minutes=5)
    assert authority.key_identifier == ca_subject_key.digest


@pytest.mark.parametrize(
    ("name", "spiffe_id"),
    [
        ("launcher", LAUNCHER_SPIFFE_ID),
        ("admin", ADMIN_SPIFFE_ID),
        ("control-plane", CONTROL_PLANE_SPIFFE_ID),
    ],
)
def test_client_certificate_carries_only_its_spiffe_id_and_a_different_cn(
    dev: DevPaths, name: str, spiffe_id: str
) -> None:
    cert = load_cert(dev.client(name)[0])
    common_names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)

    cert.verify_directly_issued_by(load_cert(dev.ca_cert))
    assert uri_sans(cert) == [spiffe_id]
    assert spiffe_ids_of(cert) == [spiffe_id]
    assert [cn.value for cn in common_names] != [spiffe_id]
    assert extended_key_usages(cert) == [ExtendedKeyUsageOID.CLIENT_AUTH]


def test_spiffe_ids_of_ignores_other_uri_sans() -> None:
    ca_cert, ca_key = make_ca("test CA")
    cert, _ = make_certificate(
        issuer_cert=ca_cert,
        issuer_key=ca_key,
        subject_cn="mixed",
        uri_sans=["https://example.com/x", "spiffe://example.org/a"],
        client=True,
    )

    assert spiffe_ids_of(cert) == ["spiffe://example.org/a"]
    assert spiffe_ids_of(ca_cert) == []


def test_dev_paths_client_rejects_names_it_does_not_create(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown dev client 'root'"):
        DevPaths.for_state_dir(tmp_path).client("root")


# --- files -----------------------------------------------------------------------------------


@pytest.mark.usefixtures("permissive_umask")
def test_secrets_are_0600_and_directories_0700_even_with_umask_zero(tmp_path: Path) -> None:
    paths = ensure_dev_material(tmp_path / "state")
    secrets = [
        paths.ca_key,
        paths.server_key,
        *(paths.client(name)[1] for name in DEV_CLIENT_SPIFFE_IDS),
        paths.signing_key,
        paths.pepper_dir / "v1",
    ]
    directories = [paths.state_dir, paths.pki_dir, paths.signing_key.parent, paths.pepper_dir]

    assert {path: stat.S_IMODE(path.stat().st_mode) for path in secrets} == dict.fromkeys(secrets, 0o600)
    assert {path: stat.S_IMODE(path.stat().st_mode) for path in directories} == dict.fromkeys(
        directories, 0o700
    )
    assert stat.S_IMODE(paths.ca_cert.stat().st_mode) & 0o022 == 0


def test_second_run_changes_no_file(tmp_path: Path) -> None:
    ensure_dev_material(tmp_path)
    before = snapshot(tmp_path)

    ensure_dev_material(tmp_path)

    assert snapshot(tmp_path) == before
    assert len(before) == 13
    assert not list(tmp_path.rglob("*.tmp"))


def test_deleted_certificate_is_reissued_for_its_existing_key(tmp_path: Path) -> None:
    paths = ensure_dev_material(tmp_path)
    cert_path, key_path = paths.client("launcher")
    old_public_key = load_cert(cert_path).public_key()
    cert_path.unlink()
    others = snapshot(tmp_path)

    ensure_dev_material(tmp_path)

    assert load_cert(cert_path).public_key() == old_public_key
    assert {path: snapshot(tmp_path)[path] for path in others} == others
    assert key_path in others


def test_certificate_without_its_key_is_an_error_not_an_overwrite(tmp_path: Path) -> None:
    paths = ensure_dev_material(tmp_path)
    paths.server_key.unlink()
    before = snapshot(tmp_path)

    with pytest.raises(DevMaterialError, match=r"server\.key is missing"):
        ensure_dev_material(tmp_path)
    assert snapshot(tmp_path) == before


def test_leaf_from_a_previous_ca_is_reported_not_silently_kept(tmp_path: Path) -> None:
    paths = ensure_dev_material(tmp_path)
    server_before = paths.server_cert.read_bytes()
    paths.ca_cert.unlink()
    paths.ca_key.unlink()

    with pytest.raises(DevMaterialError, match="not issued by the current dev CA"):
        ensure_dev_material(tmp_path)
    assert paths.server_cert.read_bytes() == server_before


def test_concurrent_first_runs_agree_on_one_consistent_pki(tmp_path: Path) -> None:
    start = threading.Barrier(6)

    def run() -> DevPaths:
        start.wait()
        return ensure_dev_material(tmp_path)

    with ThreadPoolExecutor(max_workers=6) as pool:
        results = [future.result() for future in [pool.submit(run) for _ in range(6)]]

    ca = load_cert(results[0].ca_cert)
    load_cert(results[0].server_cert).verify_directly_issued_by(ca)
    assert len(snapshot(tmp_path)) == 13
    assert not list(tmp_path.rglob("*.tmp"))


def test_pepper_is_32_random_bytes_in_base64url(dev: DevPaths, tmp_path: Path) -> None:
    text = (dev.pepper_dir / "v1").read_text()
    other = ensure_dev_material(tmp_path).pepper_dir / "v1"

    assert len(base64.urlsafe_b64decode(text)) == 32
    assert text != other.read_text()


# --- signing key and trust bundle ------------------------------------------------------------


def test_trust_bundle_kid_is_the_thumbprint_and_verifies_a_signature(dev: DevPaths) -> None:
    kid, signing_key = load_signing_key(dev.signing_key)
    (entry,) = json.loads(dev.trust_bundle.read_text())["keys"]
    public_key = Ed25519PublicKey.from_public_bytes(b64url_decode(entry["x"]))
    message = b"run capability"

    public_key.verify(signing_key.sign(message), message)
    assert entry["kid"] == kid == jwk_thumbprint(public_key)
    assert {k: entry[k] for k in ("kty", "crv", "use", "alg")} == {
        "kty": "OKP",
        "crv": "Ed25519",
        "use": "sig",
        "alg": "EdDSA",
    }
    assert "d" not in entry


def test_jwk_thumbprint_matches_the_rfc8037_example() -> None:
    public_key = Ed25519PublicKey.from_public_bytes(b64url_decode(RFC8037_X))

    assert jwk_thumbprint(public_key) == RFC8037_THUMBPRINT


def test_load_signing_key_reads_the_rfc8037_private_jwk(tmp_path: Path) -> None:
    path = tmp_path / "key.jwk"
    jwk = {"kty": "OKP", "crv": "Ed25519", "x": RFC8037_X, "d": RFC8037_D, "kid": "k1"}
    path.write_text(json.dumps(jwk))

    kid, key = load_signing_key(path)

    assert kid == "k1"
    assert jwk_thumbprint(key.public_key()) == RFC8037_THUMBPRINT


def test_load_signing_key_rejects_a_mismatched_x_without_echoing_d(tmp_path: Path) -> None:
    path = tmp_path / "key.jwk"
    wrong_x = base64.urlsafe_b64encode(bytes(32)).rstrip(b"=").decode()
    path.write_text(json.dumps({"kty": "OKP", "crv": "Ed25519", "x": wrong_x, "d": RFC8037_D, "kid": "k"}))

    with pytest.raises(ValueError, match="'x' does not match") as raised:
        load_signing_key(path)
    assert RFC8037_D not in str(raised.value)


def test_trust_bundle_missing_the_signing_key_is_reported(tmp_path: Path) -> None:
    paths = ensure_dev_material(tmp_path)
    paths.trust_bundle.write_text(json.dumps({"keys": []}))

    with pytest.raises(DevMaterialError, match="does not list the signing key"):
        ensure_dev_material(tmp_path)


# --- issuing client certificates -------------------------------------------------------------


def test_issue_client_certificate_signs_the_spiffe_id_with_the_dev_ca(dev: DevPaths, tmp_path: Path) -> None:
    spiffe_id = "spiffe://dev.local/ns/team-a/sa/summariser"

    cert_path, key_path = issue_client_certificate(dev, spiffe_id, tmp_path / "out", name="agent")
    cert = load_cert(cert_path)

    assert (cert_path.name, key_path.name) == ("agent.crt", "agent.key")
    cert.verify_directly_issued_by(load_cert(dev.ca_cert))
    assert uri_sans(cert) == [spiffe_id]
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value != spiffe_id
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600


@pytest.mark.parametrize(
    ("spiffe_id", "message"),
    [
        ("https://x", "must start with 'spiffe://'"),
        ("spiffe://", "has no trust domain"),
        ("spiffe:///ns/a", "has no trust domain"),
        ("spiffe://Dev.Local/x", "invalid trust domain"),
        ("spiffe://dev.local/", "invalid path"),
        ("spiffe://dev.local/a//b", "invalid path"),
        ("spiffe://dev.local/../admin", "invalid path"),
        ("spiffe://dev.local/a?b=c", "invalid path"),
    ],
)
def test_issue_client_certificate_rejects_invalid_spiffe_ids(
    dev: DevPaths, tmp_path: Path, spiffe_id: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        issue_client_certificate(dev, spiffe_id, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_issue_client_certificate_refuses_to_overwrite(dev: DevPaths, tmp_path: Path) -> None:
    (tmp_path / "client.key").write_text("keep me")

    with pytest.raises(FileExistsError, match="already exists"):
        issue_client_certificate(dev, LAUNCHER_SPIFFE_ID, tmp_path)
    assert (tmp_path / "client.key").read_text() == "keep me"


def test_issue_client_certificate_rejects_a_name_with_a_path(dev: DevPaths, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="plain file name"):
        issue_client_certificate(dev, LAUNCHER_SPIFFE_ID, tmp_path, name="../escape")


# --- real mutual TLS -------------------------------------------------------------------------


def server_context(dev: DevPaths) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(dev.server_cert, dev.server_key)
    context.load_verify_locations(dev.ca_cert)
    context.verify_mode = ssl.CERT_REQUIRED
    context.verify_flags |= ssl.VERIFY_X509_STRICT
    return context


def client_context(dev: DevPaths, chain: tuple[Path, Path] | None) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(dev.ca_cert)
    context.verify_flags |= ssl.VERIFY_X509_STRICT
    if chain is not None:
        context.load_cert_chain(*chain)
    return context


def serve_one(listener: socket.socket, context: ssl.SSLContext) -> list[str]:
    """Accept one TLS connection; returns the peer's URI SANs or raises the handshake error."""
    conn, _ = listener.accept()
    conn.settimeout(5)
    with context.wrap_socket(conn, server_side=True) as tls:
        peer = tls.getpeercert() or {}
        tls.sendall(b"ok")
    sans = cast("tuple[tuple[str, str], ...]", peer.get("subjectAltName", ()))
    return [value for kind, value in sans if kind == "URI"]


def connect(port: int, context: ssl.SSLContext, server_hostname: str) -> bytes:
    """The server's greeting, or b"" when the server refused us (seen here as an alert or EOF)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        try:
            with context.wrap_socket(raw, server_hostname=server_hostname) as tls:
                return tls.recv(2)
        except (ssl.SSLError, ConnectionError):
            return b""


def handshake(
    dev: DevPaths, client: ssl.SSLContext, server_hostname: str = "localhost"
) -> tuple[bytes, list[str]]:
    with (
        socket.create_server(("127.0.0.1", 0)) as listener,
        ThreadPoolExecutor(max_workers=1) as pool,
    ):
        listener.settimeout(5)
        served = pool.submit(serve_one, listener, server_context(dev))
        greeting = connect(listener.getsockname()[1], client, server_hostname)
        return greeting, served.result(timeout=10)


@pytest.mark.parametrize("server_hostname", ["localhost", "127.0.0.1"])
def test_mtls_server_accepts_the_launcher_and_sees_its_spiffe_id(dev: DevPaths, server_hostname: str) -> None:
    client = client_context(dev, dev.client("launcher"))

    greeting, peer_uris = handshake(dev, client, server_hostname)

    assert greeting == b"ok"
    assert peer_uris == [LAUNCHER_SPIFFE_ID]


def test_mtls_server_rejects_a_client_certificate_from_another_ca(dev: DevPaths, tmp_path: Path) -> None:
    other_ca, other_key = make_ca("tokensvc dev CA")  # same name, different key
    cert, key = make_certificate(
        issuer_cert=other_ca,
        issuer_key=other_key,
        subject_cn="intruder",
        uri_sans=[LAUNCHER_SPIFFE_ID],
        client=True,
    )
    (tmp_path / "c.crt").write_bytes(pem_cert(cert))
    (tmp_path / "c.key").write_bytes(pem_key(key))
    client = client_context(dev, (tmp_path / "c.crt", tmp_path / "c.key"))

    with pytest.raises(ssl.SSLError, match="certificate verify failed"):
        handshake(dev, client)


def test_mtls_server_rejects_a_client_without_a_certificate(dev: DevPaths) -> None:
    with pytest.raises(ssl.SSLError, match="PEER_DID_NOT_RETURN_A_CERTIFICATE"):
        handshake(dev, client_context(dev, None))
