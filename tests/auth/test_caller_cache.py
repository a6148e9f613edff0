"""Callers cached by peer certificate: parsed once, refusals never cached, bounded."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokensvc.auth import identity
from tokensvc.auth.devpki import DEV_TRUST_DOMAIN, DevPaths, issue_client_certificate
from tokensvc.auth.identity import CallerCache, IdentityPolicy, Role
from tokensvc.errors import Unauthenticated

POLICY = IdentityPolicy(
    trust_domain=DEV_TRUST_DOMAIN,
    launcher_template="spiffe://{trust_domain}/ns/{namespace}/sa/{agent}",
    admin_ids=[],
    control_plane_ids=[],
)


def pem_of(dev: DevPaths, tmp_path: Path, agent: str) -> dict[str, list[bytes]]:
    cert, _ = issue_client_certificate(
        dev, f"spiffe://{DEV_TRUST_DOMAIN}/ns/default/sa/{agent}", tmp_path, agent
    )
    return {"x509_pem_cert": [cert.read_bytes()]}


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts certificate parses (cryptography's loader, wherever it is called from)."""
    count = [0]
    load = identity.x509.load_pem_x509_certificate

    def counting(data: bytes) -> object:
        count[0] += 1
        return load(data)

    monkeypatch.setattr(identity.x509, "load_pem_x509_certificate", counting)
    return count


def test_a_peer_certificate_is_parsed_once_and_gives_the_same_caller(
    dev: DevPaths, tmp_path: Path, parses: list[int]
) -> None:
    cache = CallerCache(POLICY)
    context, other_context = pem_of(dev, tmp_path, "agent-a"), pem_of(dev, tmp_path, "agent-b")
    parses[0] = 0  # issuing the certificates parsed some too
    first = cache.identify(context)
    assert first.roles == frozenset({Role.LAUNCHER})
    assert first.workload == ("default", "agent-a")
    assert all(cache.identify(context) is first for _ in range(5))
    assert parses[0] == 1
    other = cache.identify(other_context)
    assert other.workload == ("default", "agent-b")
    assert parses[0] == 2


def test_a_refused_certificate_is_refused_every_time_and_never_cached(
    dev: DevPaths, tmp_path: Path, parses: list[int]
) -> None:
    cache = CallerCache(POLICY)
    for context in ({"x509_pem_cert": [b"-----BEGIN CERTIFICATE-----\nnot one\n"]}, {}):
        for _ in range(3):
            with pytest.raises(Unauthenticated):
                cache.identify(context)
    assert len(cache._entries) == 0


def test_the_cache_is_bounded_least_recently_used_first(
    dev: DevPaths, tmp_path: Path, parses: list[int]
) -> None:
    cache = CallerCache(POLICY, capacity=2)
    a, b, c = (pem_of(dev, tmp_path, name) for name in ("agent-a", "agent-b", "agent-c"))
    cache.identify(a)
    cache.identify(b)
    cache.identify(a)  # a is now the most recent
    cache.identify(c)  # evicts b
    parses[0] = 0
    cache.identify(a)
    assert parses[0] == 0
    cache.identify(b)
    assert parses[0] == 1
