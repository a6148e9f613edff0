"""How many statements each RPC sends to PostgreSQL, counted by the server itself.

The embedded server logs every statement it executes (`log_statement = all`, switched on for this
test only); the service runs on ONE pooled connection, so its backend's log lines are exactly what
the RPCs sent. A simple-protocol message (the tenant transaction's `BEGIN ...; SELECT set_config`)
is one line, one round trip; an extended-protocol execution is one line each. The counts are
recorded below: the test fails when a path sends more (and prints every count, so a path that
got cheaper can be written down too).
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.api.knowledge_support import open_clients
from tests.api.memory_support import Launchers, superuser
from tests.conftest import ServiceFactory
from tests.support import SharedDatabase
from tokensvc.auth.devpki import DevPaths
from tokensvc.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    capability_pb2,
    capability_pb2_grpc,
    common_pb2,
    knowledge_pb2,
    memory_pb2,
)

# Statements of the service's own background duties (revocation polling, health probes, the
# database gauges, the TTL sweeper, unfinished vector indexes): not part of any RPC.
_BACKGROUND = re.compile(
    r"capability_revocations WHERE|FROM capability_revocations\s*$|^SELECT 1$|memory_rows_by_space|sweep_expired_memories"
    r"|FROM credential_rotations WHERE outcome = 'in_progress'|FROM embedding_migrations WHERE state <> ALL"
    # The embedding-migration runner's poll for work (every replica, every poll_seconds).
    r"|^UPDATE embedding_migrations SET lease_owner = \$1"
    # The vector-indexes duty's look for unfinished builds (every replica, every 5 s).
    r"|FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
)

# RPC (and path) -> statements sent, at most. A tenant transaction is at least 3 (the BEGIN
# message with the tenant, the statement, COMMIT); two of them mean a read, then (after embedding
# outside any transaction) a write.
EXPECTED = {
    "SearchMemories vector (warm)": 3,
    "SearchMemories hybrid (warm)": 3,
    "SearchMemories text (warm)": 3,
    "SearchMemories vector (first of a bucket)": 4,  # + the bucket's row count, same transaction
    "Remember (new content)": 7,  # read: known content/keys; write: clear expired twins, insert
    "Remember (known content)": 3,
    "GetMemory": 3,
    "ListMemories": 3,
    "UpdateMemory (metadata)": 6,  # read the row (to merge), write it
    "UpdateMemory (content)": 6,
    "Forget": 3,
    "ForgetAll": 3,
    "VerifyCapability": 0,
    "DeriveSessionKey": 0,
    "RevokeCapability": 2,  # the revocation, its audit event
    "CreateKnowledgeBase": 5,  # the insert, the vector index check, the audit event
    "GetKnowledgeBase": 3,
    "ListKnowledgeBases": 3,
    # The serving role's: under the document's lock its state and newest versions, then one write
    # (the version queued with its bytes); the ingestion is the runner role's, on its own pool.
    "UploadDocument (new)": 5,
    "UploadDocument (same bytes)": 4,  # read under the lock (3 before background ingestion: no lock)
    "UploadDocument (same bytes, new metadata)": 5,
    "UploadDocument (new version)": 5,
    "GetDocument": 3,
    "ListDocuments": 3,
    "SearchKnowledge hybrid (warm)": 3,  # the remembered pins are checked with BEGIN
    "SearchKnowledge vector (warm)": 3,
    "DeleteDocument": 3,
    "DeleteKnowledgeBase": 5,  # the delete, its migrations' cancel (after the delete's lock), the audit event
    "ListAuditEvents": 1,
    "GetCredentialStatus": 9,  # pepper counts, then the serving and the runner journal (a snapshot each)
}


@dataclass
class StatementLog:
    """The server log lines of one backend from a mark on."""

    path: Path
    backend: int
    offset: int = 0

    def mark(self) -> None:
        self.offset = self.path.stat().st_size

    def statements(self) -> list[str]:
        with self.path.open("rb") as log:
            log.seek(self.offset)
            text = log.read().decode("utf-8", "replace")
        pattern = re.compile(rf"\[{self.backend}\] LOG:  (?:statement|execute [^:]*): (.*)")
        found = [m.group(1).strip() for m in pattern.finditer(text)]
        return [s for s in found if not _BACKGROUND.search(s)]


@pytest.fixture
async def counted(
    database: SharedDatabase, start_service: ServiceFactory
) -> AsyncIterator[tuple[Any, StatementLog]]:
    async with superuser(database) as conn:
        await conn.execute("ALTER SYSTEM SET log_statement = 'all'")
        await conn.execute("SELECT pg_reload_conf()")
    try:
        service = await start_service(
            pool_min_size=1,
            pool_max_size=1,
            health_check_interval_seconds=3600,
            memory_sweep_interval_seconds=3600,
        )
        pool = service.database.pool
        for _ in range(100):  # the reload reaches the backend at its next command
            if await pool.fetchval("SELECT current_setting('log_statement')") == "all":
                break
            await asyncio.sleep(0.05)
        backend = await pool.fetchval("SELECT pg_backend_pid()")
        yield service, StatementLog(database.server.paths.log, int(backend))
    finally:
        async with superuser(database) as conn:
            await conn.execute("ALTER SYSTEM RESET log_statement")
            await conn.execute("SELECT pg_reload_conf()")


async def measure(log: StatementLog, call: Callable[[], Awaitable[Any]], repeat: int = 2) -> list[str]:
    """The statements of one call: the fewest of `repeat` runs (a background duty that lands
    inside one run's window cannot inflate the count)."""
    best: list[str] | None = None
    for _ in range(repeat):
        await asyncio.sleep(0.05)
        log.mark()
        await call()
        await asyncio.sleep(0.05)  # the log is written by the backend as it executes
        seen = log.statements()
        if best is None or len(seen) < len(best):
            best = seen
    assert best is not None
    return best


async def test_each_rpc_sends_no_more_statements_than_recorded(
    counted: tuple[Any, StatementLog], dev: DevPaths, tmp_path: Path
) -> None:
    service, log = counted
    launchers = Launchers(service, dev, tmp_path / "launchers")
    measured: dict[str, list[str]] = {}

    async def record(name: str, call: Callable[[], Awaitable[Any]], repeat: int = 2) -> None:
        measured[name] = await measure(log, call, repeat)

    try:
        agent = launchers.new_agent()
        caller = launchers.caller(agent, user="user-one", per_user=True)
        ids = await caller.remember("the first memory of this bucket", "a second memory")
        await caller.search("warm the space cache")

        def search(mode: int, query: str | bytes = "first memory") -> Callable[[], Awaitable[Any]]:
            return lambda: caller.search(query, mode=common_pb2.SearchMode.ValueType(mode), top_k=5)

        await record("SearchMemories vector (warm)", search(common_pb2.SEARCH_MODE_VECTOR))
        await record("SearchMemories hybrid (warm)", search(common_pb2.SEARCH_MODE_HYBRID))
        await record("SearchMemories text (warm)", search(common_pb2.SEARCH_MODE_TEXT))

        async def first_search_of_a_bucket() -> None:
            fresh = launchers.caller(agent, user=f"user-{uuid.uuid4().hex[:8]}", per_user=True)
            await fresh.search("nothing here yet", mode=common_pb2.SEARCH_MODE_VECTOR)

        await record("SearchMemories vector (first of a bucket)", first_search_of_a_bucket)
        counter = iter(range(1_000_000))
        await record("Remember (new content)", lambda: caller.remember(f"new memory number {next(counter)}"))
        await record("Remember (known content)", lambda: caller.remember("a second memory"))
        await record("GetMemory", lambda: caller.call("GetMemory", memory_pb2.GetMemoryRequest(id=ids[0])))
        await record(
            "ListMemories", lambda: caller.call("ListMemories", memory_pb2.ListMemoriesRequest(page_size=2))
        )
        await record(
            "UpdateMemory (metadata)",
            lambda: caller.call(
                "UpdateMemory",
                memory_pb2.UpdateMemoryRequest(
                    id=ids[0], metadata={"n": common_pb2.MetadataValue(number_value=next(counter))}
                ),
            ),
        )
        await record(
            "UpdateMemory (content)",
            lambda: caller.call(
                "UpdateMemory",
                memory_pb2.UpdateMemoryRequest(id=ids[1], content=f"changed content {next(counter)}"),
            ),
        )
        await record("Forget", lambda: caller.call("Forget", memory_pb2.ForgetRequest(ids=[ids[0]])))
        await record("ForgetAll", lambda: caller.call("ForgetAll", memory_pb2.ForgetAllRequest()))

        capabilities = capability_pb2_grpc.CapabilityServiceStub(caller.channel)
        await record(
            "VerifyCapability",
            lambda: capabilities.VerifyCapability(
                capability_pb2.VerifyCapabilityRequest(), metadata=caller.metadata
            ),
        )
        await record(
            "DeriveSessionKey",
            lambda: capabilities.DeriveSessionKey(
                capability_pb2.DeriveSessionKeyRequest(conversation_id="conv-1"), metadata=caller.metadata
            ),
        )

        async with open_clients(service, dev) as clients:
            manager = clients.manager()
            control = capability_pb2_grpc.CapabilityServiceStub(clients.channel("control-plane"))
            await record(
                "RevokeCapability",
                lambda: control.RevokeCapability(
                    capability_pb2.RevokeCapabilityRequest(jti=f"jti-{next(counter)}", reason="test")
                ),
            )
            refs = iter(f"kb-{uuid.uuid4().hex[:8]}" for _ in range(10))
            kb = next(refs)
            await record("CreateKnowledgeBase", lambda: manager.create(next(refs)), repeat=1)
            await manager.create(kb)
            await record("GetKnowledgeBase", lambda: manager.get(kb))
            await record(
                "ListKnowledgeBases",  # one page (the shared namespace may hold many bases)
                lambda: manager.stub.ListKnowledgeBases(
                    knowledge_pb2.ListKnowledgeBasesRequest(namespace=manager.namespace, page_size=2)
                ),
            )
            docs = iter(range(1_000))
            text = "# Title\n\nSome words about statement counts.\n\n## Part\n\nMore words here.\n"
            await record("UploadDocument (new)", lambda: manager.upload(kb, f"doc-{next(docs)}", text))
            await manager.upload(kb, "doc", text)
            await record("UploadDocument (same bytes)", lambda: manager.upload(kb, "doc", text))
            await record(
                "UploadDocument (same bytes, new metadata)",
                lambda: manager.upload(kb, "doc", text, metadata={"n": float(next(counter))}),
            )
            await record(
                "UploadDocument (new version)",
                lambda: manager.upload(kb, "doc", f"{text}\n{next(counter)}\n"),
            )
            await record("GetDocument", lambda: manager.get_document(kb, "doc"))
            await record("ListDocuments", lambda: manager.list_documents(kb, page_size=100))
            searcher = clients.searcher([kb])
            await searcher.search("warm the corpus count")
            await record("SearchKnowledge hybrid (warm)", lambda: searcher.search("statement counts"))
            await record(
                "SearchKnowledge vector (warm)",
                lambda: searcher.search("statement counts", mode=common_pb2.SEARCH_MODE_VECTOR),
            )
            await record(
                "DeleteDocument", lambda: manager.delete_document(kb, f"doc-{next(iter(range(1)))}"), repeat=1
            )
            await record("DeleteKnowledgeBase", lambda: manager.delete(kb), repeat=1)
            admin = admin_pb2_grpc.AdminServiceStub(clients.channel("admin"))
            await record(
                "ListAuditEvents",
                lambda: admin.ListAuditEvents(admin_pb2.ListAuditEventsRequest(page_size=5)),
            )
            await record(
                "GetCredentialStatus",
                lambda: admin.GetCredentialStatus(admin_pb2.GetCredentialStatusRequest()),
            )
    finally:
        await launchers.aclose()

    report = "\n".join(f"{name}: {len(sql)}\n    " + "\n    ".join(sql) for name, sql in measured.items())
    print(report)
    assert set(measured) == set(EXPECTED), "every measured path has a recorded count"
    grown = {name: len(sql) for name, sql in measured.items() if len(sql) > EXPECTED[name]}
    assert not grown, f"paths that send more statements than recorded: {grown}\n{report}"
