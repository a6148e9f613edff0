"""Every implementation serves each of the re-embedding ports its callers take (the operator's
calls, the runner, each kind's backfill): every method a port declares, with its parameters.

mypy checks the PostgreSQL store against them where the composition root hands it over; this
checks both stores, the in-process one included, at run time.
"""

from __future__ import annotations

import inspect

import pytest

from tests.storage.conformance.conftest import Backend
from tokensvc.storage.ports import (
    EmbeddingMigrationStore,
    KnowledgeBackfillStore,
    MemoryBackfillStore,
    MigrationOperationsStore,
    MigrationRunnerStore,
    MigrationStateStore,
)

PORTS = (
    MigrationStateStore,
    MigrationOperationsStore,
    MemoryBackfillStore,
    KnowledgeBackfillStore,
    MigrationRunnerStore,
    EmbeddingMigrationStore,
)


def declared(port: type) -> dict[str, inspect.Signature]:
    """The methods `port` declares, its bases' included, by name."""
    return {
        name: inspect.signature(member)
        for name, member in inspect.getmembers(port, inspect.iscoroutinefunction)
        if not name.startswith("_")
    }


def test_the_narrow_ports_together_are_the_whole_port() -> None:
    whole = set(declared(EmbeddingMigrationStore))
    assert len(whole) == 17
    assert set().union(*(declared(port) for port in PORTS[:-1])) == whole
    assert set(declared(MemoryBackfillStore)) | set(declared(KnowledgeBackfillStore)) <= set(
        declared(MigrationRunnerStore)
    )


@pytest.mark.parametrize("port", PORTS, ids=lambda port: port.__name__)
def test_the_store_serves_every_method_of_the_port(backend: Backend, port: type) -> None:
    store = backend.migrations
    for name, signature in declared(port).items():
        method = getattr(store, name, None)
        assert inspect.iscoroutinefunction(method), f"{type(store).__name__} has no async {name}"
        wanted = [(p.name, p.kind) for p in signature.parameters.values() if p.name != "self"]
        served = [(p.name, p.kind) for p in inspect.signature(method).parameters.values()]
        assert served == wanted, (
            f"{type(store).__name__}.{name}{inspect.signature(method)} is not {signature}"
        )
