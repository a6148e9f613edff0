"""One tenant floods the embedded model; another tenant's Remember and search still get through.

Two launchers of two namespaces over mTLS gRPC against one service on the real default model
(multilingual-e5-small): the flooding one sends large Remembers and its control plane uploads a
document, the quiet one sends one short Remember. With one first-in-first-out queue the short
Remember waited for every slice of the large ones; fairly scheduled, it is embedded after the
slices already running, so it finishes while the flood's later slices still wait. Ordering, not
wall-clock thresholds: the assertion is that the flood still has texts queued when the quiet call
has returned.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.api.knowledge_support import Manager
from tests.support import dev_capability, failure_of, mtls_channel, role_channel
from tokensvc.auth.devpki import DevPaths, issue_client_certificate
from tokensvc.embedders import WorkClass
from tokensvc.embedders.registry import DEFAULT_EMBEDDER
from tokensvc.v1 import memory_pb2, memory_pb2_grpc

pytestmark = pytest.mark.slow

DEADLINE = 600.0


def essay(seed: int, chars: int) -> str:
    """Distinct text (nothing deduplicated) of `chars` characters."""
    pick = random.Random(seed)
    out: list[str] = []
    used = 0
    while used < chars:
        out.append(f"topic{pick.randrange(5000)}")
        used += len(out[-1]) + 1
    return " ".join(out)[:chars]


class Launcher:
    def __init__(self, port: int, dev: DevPaths, directory: Path, namespace: str, agent: str) -> None:
        spiffe_id = f"spiffe://dev.local/ns/{namespace}/sa/{agent}"
        cert, key = issue_client_certificate(dev, spiffe_id, directory, name=f"{namespace}-{agent}")
        self.channel = mtls_channel(port, dev.ca_cert, cert, key)
        self.stub = memory_pb2_grpc.MemoryServiceStub(self.channel)
        token = dev_capability(dev, namespace=namespace, agent=agent, long_term_memory=True)
        self.metadata = (("authorization", f"Bearer {token}"),)

    async def remember(self, *contents: str) -> memory_pb2.RememberResponse:
        request = memory_pb2.RememberRequest(items=[memory_pb2.RememberItem(content=c) for c in contents])
        response: memory_pb2.RememberResponse = await self.stub.Remember(
            request, metadata=self.metadata, timeout=DEADLINE
        )
        return response

    async def search(self, query: str) -> list[str]:
        request = memory_pb2.SearchMemoriesRequest(query_text=query, top_k=1)
        found = await self.stub.SearchMemories(request, metadata=self.metadata, timeout=DEADLINE)
        return [result.memory.content for result in found.results]


async def test_a_quiet_tenants_remember_finishes_while_another_tenant_floods_the_model(
    start_service: Any, dev: DevPaths, tmp_path: Path
) -> None:
    service = await start_service(memory_embedder=DEFAULT_EMBEDDER)
    flood = Launcher(service.port, dev, tmp_path, "flood", "bulk-writer")
    quiet = Launcher(service.port, dev, tmp_path, "quiet", "assistant")
    control = role_channel(service.port, dev, "control-plane")
    handbook = Manager(control, namespace="flood")
    try:
        await handbook.create("handbook", embedder=DEFAULT_EMBEDDER)
        # Twelve memories of 8 KiB: twelve slices, each holding a model thread for seconds.
        big = [asyncio.ensure_future(flood.remember(*(essay(i, 8192) for i in range(12))))]
        big.append(asyncio.ensure_future(flood.remember(*(essay(100 + i, 8192) for i in range(4)))))
        document = "\n\n".join(f"# Part {i}\n\n{essay(200 + i, 1500)}" for i in range(6))
        big.append(
            asyncio.ensure_future(handbook.upload("handbook", "guide.md", document, deadline=DEADLINE))
        )

        scheduler = service.embedders.get(DEFAULT_EMBEDDER).scheduler  # type: ignore[union-attr]
        # Both Remembers wait behind the slices already running (two threads, one 8 KiB text a slice).
        for _ in range(6000):
            if scheduler.queued_texts(WorkClass.INTERACTIVE, "flood/bulk-writer") >= 12:
                break
            await asyncio.sleep(0.01)
        assert scheduler.queued_texts(WorkClass.INTERACTIVE, "flood/bulk-writer") >= 12

        stored = await quiet.remember("The team offsite is in Porto on the second week of May.")
        assert len(stored.results) == 1
        assert not stored.results[0].deduplicated
        # Embedded ahead of the flood's remaining slices: they are still waiting.
        assert scheduler.queued_texts(WorkClass.INTERACTIVE, "flood/bulk-writer") > 0
        assert not all(call.done() for call in big[:2])
        assert await quiet.search("where is the offsite") == [
            "The team offsite is in Porto on the second week of May."
        ]

        # Nothing that would have succeeded alone failed.
        first, second, upload = await asyncio.gather(*big)
        assert len(first.results) == 12
        assert len(second.results) == 4
        assert upload.document.chunk_count > 0
    finally:
        for channel in (flood.channel, quiet.channel, control):
            await channel.close(grace=None)


async def test_a_tenant_past_its_embedder_queue_gets_resource_exhausted_and_the_reason(
    start_service: Any, dev: DevPaths, tmp_path: Path
) -> None:
    """The queue bound over gRPC: a second large call while the first waits is refused with
    RESOURCE_EXHAUSTED / CONCURRENCY_LIMIT, and the first still succeeds."""
    service = await start_service(memory_embedder=DEFAULT_EMBEDDER, embedder_queue_texts=8)
    flood = Launcher(service.port, dev, tmp_path, "flood", "eager")
    try:
        first = asyncio.ensure_future(flood.remember(*(essay(300 + i, 4096) for i in range(10))))
        scheduler = service.embedders.get(DEFAULT_EMBEDDER).scheduler  # type: ignore[union-attr]
        for _ in range(6000):
            if scheduler.queued_texts(WorkClass.INTERACTIVE, "flood/eager") > 0:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await flood.remember(*(essay(400 + i, 64) for i in range(8)))
        refused = failure_of(caught.value)
        assert (refused.code, refused.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "CONCURRENCY_LIMIT")
        assert "texts waiting for the embedder" in refused.message
        assert len((await first).results) == 10
    finally:
        await flood.channel.close(grace=None)
