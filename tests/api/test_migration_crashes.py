"""A re-embedding runner SIGKILLed at any point of a migration: another replica takes the lease
over and the migration completes exactly once, nothing lost, duplicated or embedded twice.

Real `tokensvc serve` processes on the shared database; the first is killed (SIGKILL, no cleanup)
before its first batch, mid-way, at its last batch, or just after the cutover (a knowledge base's
migration: mid-way); a second one, started afterwards, finishes the migration once the dead one's
lease has expired.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import asyncpg
import pytest

from tests.api.knowledge_support import upload_stream
from tests.api.memory_support import TIMEOUT, Launchers
from tests.cli.test_cli import ROOT, clean_env, settings_env, wait_for_health
from tests.support import SharedDatabase, free_port, role_channel, superuser
from tokensvc.auth.devpki import CONTROL_PLANE_SPIFFE_ID, DevPaths
from tokensvc.v1 import common_pb2, knowledge_pb2, knowledge_pb2_grpc, migration_pb2, migration_pb2_grpc

pytestmark = pytest.mark.slow

ROWS_PER_USER = 60
USERS = 2
BATCH = 4


def serve(database: SharedDatabase, dev: DevPaths, state: Path, embedders: Path, **settings: str) -> Any:
    port = free_port()
    env = {
        **clean_env(),
        **settings_env(database, dev, state, port),
        "TOKENSVC_EMBEDDERS_FILE": str(embedders),
        "TOKENSVC_MEMORY_EMBEDDER": "hash64",
        "TOKENSVC_MIGRATION_BATCH_SIZE": str(BATCH),
        "TOKENSVC_MIGRATION_LEASE_SECONDS": "2",
        "TOKENSVC_MEMORY_SPACE_CACHE_SECONDS": "0.2",
        "TOKENSVC_CONTROL_PLANE_SPIFFE_IDS": CONTROL_PLANE_SPIFFE_ID,
        **{f"TOKENSVC_{name.upper()}": value for name, value in settings.items()},
    }
    log = state / "stderr.log"
    state.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(
        [sys.executable, "-m", "tokensvc", "serve"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
        text=True,
    )
    wait_for_health(dev.state_dir, port, process, deadline_s=120, stderr=log)
    return SimpleNamespace(port=port, process=process)


async def migration_row(conn: asyncpg.Connection, migration_id: str) -> asyncpg.Record:
    row = await conn.fetchrow(
        "SELECT state, rows_done, rows_total, lease_owner FROM tokensvc.embedding_migrations WHERE id = $1",
        migration_id,
    )
    assert row is not None
    return row


async def wait_until(conn: asyncpg.Connection, migration_id: str, ready: Any, deadline_s: float = 180) -> Any:
    began = time.monotonic()
    while time.monotonic() - began < deadline_s:
        row = await migration_row(conn, migration_id)
        if ready(row):
            return row
        await asyncio.sleep(0.02)
    raise AssertionError(f"never reached the point: {dict(row)}")


POINTS = {
    # Killed as soon as the migration exists, before its runner has embedded its first batch.
    "before-the-first-batch": None,
    "mid-way": lambda row: row["rows_done"] >= ROWS_PER_USER // 2,
    "at-the-last-batch": lambda row: (
        row["state"] == "backfilling" and row["rows_done"] >= USERS * ROWS_PER_USER - BATCH
    ),
    "just-after-the-cutover": lambda row: row["state"] == "retiring",
}


@pytest.mark.parametrize("point", list(POINTS))
async def test_a_runner_killed_at_any_point_leaves_a_migration_that_completes_exactly_once(
    point: str, database: SharedDatabase, dev: DevPaths, tmp_path: Path
) -> None:
    embedders = tmp_path / "embedders.toml"
    embedders.write_text('[embedders.hash64]\nkind = "hash"\ndimension = 64\n', encoding="utf-8")
    # The first replica would wait a minute before removing the old vectors: killed in RETIRING.
    # Before the first batch: a batch of 64 takes the model ~0.5 s, so the kill comes first.
    batch = str(64 if point == "before-the-first-batch" else BATCH)
    first = await asyncio.to_thread(
        serve,
        database,
        dev,
        tmp_path / "a",
        embedders,
        migration_retire_seconds="60",
        migration_batch_size=batch,
    )
    launchers = Launchers(first, dev, tmp_path / "launchers")  # type: ignore[arg-type]
    agent = launchers.new_agent()
    for u in range(USERS):
        caller = launchers.caller(agent, user=f"user-{u}", per_user=True)
        await caller.remember(*(f"user {u} remembers fact number {i}" for i in range(ROWS_PER_USER)))
    control = role_channel(first.port, dev, "control-plane")
    started = await migration_pb2_grpc.MigrationServiceStub(control).StartEmbeddingMigration(
        migration_pb2.StartEmbeddingMigrationRequest(
            memory_space=migration_pb2.MemorySpaceRef(namespace="default", agent=agent),
            embedder="multilingual-e5-small",
        ),
        timeout=TIMEOUT,
    )
    migration_id = started.migration.id
    await control.close(grace=None)

    async with superuser(database) as conn:
        ready = POINTS[point]
        if ready is not None:
            await wait_until(conn, migration_id, ready)
        os.kill(first.process.pid, signal.SIGKILL)
        first.process.wait(30)
        at_kill = await migration_row(conn, migration_id)
        if point == "before-the-first-batch":
            assert at_kill["rows_done"] == 0
        if point == "at-the-last-batch":
            assert at_kill["state"] == "backfilling"

        second = await asyncio.to_thread(
            serve, database, dev, tmp_path / "b", embedders, migration_retire_seconds="1"
        )
        try:
            done = await wait_until(conn, migration_id, lambda row: row["state"] == "succeeded")
            # Each memory embedded once: a batch killed before its commit was redone, none after.
            assert (done["rows_done"], done["rows_total"]) == (USERS * ROWS_PER_USER, USERS * ROWS_PER_USER)
            rows = await conn.fetchrow(
                "SELECT count(*) AS n, count(DISTINCT content) AS contents, count(embedding) AS old, "
                "count(*) FILTER (WHERE dimension_b = 384) AS new FROM tokensvc.memories WHERE agent = $1",
                agent,
            )
            assert tuple(rows) == (USERS * ROWS_PER_USER, USERS * ROWS_PER_USER, 0, USERS * ROWS_PER_USER)
            space = await conn.fetchrow(
                "SELECT embedder, dimension, generation FROM tokensvc.memory_spaces WHERE agent = $1", agent
            )
            assert tuple(space) == ("multilingual-e5-small", 384, 1)
            cutovers = await conn.fetchval(
                "SELECT count(*) FROM tokensvc.audit_events WHERE action = 'cut over embedding migration' "
                "AND target LIKE $1",
                f"migration:{migration_id}%",
            )
            assert cutovers == 1
            # The second replica serves the migrated space with the new model.
            caller = launchers.caller(agent, user="user-1", per_user=True, service=second)
            found = await caller.search(
                "user 1 remembers fact number 7", top_k=1, mode=common_pb2.SEARCH_MODE_VECTOR
            )
            assert found[0].memory.content == "user 1 remembers fact number 7"
        finally:
            await launchers.aclose()
            second.process.send_signal(signal.SIGINT)
            second.process.wait(30)


DOCUMENTS = 48  # three of the runner's 16-document batches


async def test_a_runner_killed_mid_way_through_a_knowledge_base_leaves_it_to_complete_once(
    database: SharedDatabase, dev: DevPaths, tmp_path: Path
) -> None:
    embedders = tmp_path / "embedders.toml"
    embedders.write_text('[embedders.hash64]\nkind = "hash"\ndimension = 64\n', encoding="utf-8")
    first = await asyncio.to_thread(
        serve, database, dev, tmp_path / "a", embedders, migration_retire_seconds="60"
    )
    kb = f"kb-{os.urandom(4).hex()}"
    control = role_channel(first.port, dev, "control-plane")
    manager = knowledge_pb2_grpc.KnowledgeServiceStub(control)
    await manager.CreateKnowledgeBase(
        knowledge_pb2.CreateKnowledgeBaseRequest(
            namespace="default",
            ref=kb,
            embedder="hash64",
            chunking=knowledge_pb2.ChunkingStrategy(kind=knowledge_pb2.CHUNKING_KIND_RECURSIVE),
        ),
        timeout=TIMEOUT,
    )
    for i in range(DOCUMENTS):
        await manager.UploadDocument(
            upload_stream(kb, f"doc-{i:02}", f"document number {i}".encode()), timeout=TIMEOUT
        )
    started = await migration_pb2_grpc.MigrationServiceStub(control).StartEmbeddingMigration(
        migration_pb2.StartEmbeddingMigrationRequest(
            knowledge_base=migration_pb2.KnowledgeBaseRef(namespace="default", ref=kb),
            embedder="multilingual-e5-small",
        ),
        timeout=TIMEOUT,
    )
    migration_id = started.migration.id
    await control.close(grace=None)

    async with superuser(database) as conn:
        await wait_until(conn, migration_id, lambda row: row["rows_done"] >= 16)
        os.kill(first.process.pid, signal.SIGKILL)
        first.process.wait(30)
        at_kill = await migration_row(conn, migration_id)
        assert at_kill["state"] == "backfilling"
        assert 16 <= at_kill["rows_done"] < DOCUMENTS
        second = await asyncio.to_thread(
            serve, database, dev, tmp_path / "b", embedders, migration_retire_seconds="1"
        )
        try:
            done = await wait_until(conn, migration_id, lambda row: row["state"] == "succeeded")
            # Each document written once: the batch the kill interrupted was redone, none other.
            assert (done["rows_done"], done["rows_total"]) == (DOCUMENTS, DOCUMENTS)
            chunks = await conn.fetch(
                "SELECT generation, dimension, count(*) AS n, count(DISTINCT doc_ref) AS documents "
                "FROM tokensvc.chunks WHERE kb_ref = $1 GROUP BY 1, 2",
                kb,
            )
            assert [tuple(r) for r in chunks] == [(1, 384, DOCUMENTS, DOCUMENTS)]
            base = await conn.fetchrow(
                "SELECT embedder, dimension, generation FROM tokensvc.knowledge_bases WHERE ref = $1", kb
            )
            assert tuple(base) == ("multilingual-e5-small", 384, 1)
            cutovers = await conn.fetchval(
                "SELECT count(*) FROM tokensvc.audit_events WHERE action = 'cut over embedding migration' "
                "AND target LIKE $1",
                f"migration:{migration_id}%",
            )
            assert cutovers == 1
        finally:
            second.process.send_signal(signal.SIGINT)
            second.process.wait(30)
