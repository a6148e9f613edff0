"""Knowledge search ranking on the real database: the pinned text-search configuration (refused
when changed, validated by name), stemmed TEXT search, and neighbour chunks in HYBRID mode."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from tests.api.knowledge_support import FIXED, RECURSIVE, Clients, failure, new_ref, open_clients
from tokensvc.app import Service
from tokensvc.auth.devpki import DevPaths
from tokensvc.v1 import common_pb2

TEXT = common_pb2.SEARCH_MODE_TEXT
HYBRID = common_pb2.SEARCH_MODE_HYBRID


@pytest.fixture
async def clients(service: Service, dev: DevPaths) -> AsyncIterator[Clients]:
    async with open_clients(service, dev) as opened:
        yield opened


async def test_a_knowledge_base_pins_its_text_search_config(clients: Clients) -> None:
    manager = clients.manager()
    ref = new_ref()
    created = await manager.create(ref, FIXED, 32, text_search_config="simple")
    assert created.knowledge_base.text_search_config == "simple"
    # The same or an empty config is the same knowledge base; another one is refused.
    assert not (await manager.create(ref, FIXED, 32, text_search_config="simple")).created
    assert (await manager.create(ref, FIXED, 32)).knowledge_base.text_search_config == "simple"
    refused = await failure(manager.create(ref, FIXED, 32, text_search_config="english"))
    assert refused.code == grpc.StatusCode.FAILED_PRECONDITION
    assert refused.reason == "PINNED_CONFIGURATION"
    assert (await manager.get(ref)).text_search_config == "simple"
    assert (await manager.create(new_ref(), FIXED, 32)).knowledge_base.text_search_config == "english"


@pytest.mark.parametrize("config", ["klingon", "english\x00", "pg_catalog.english", "x" * 300])
async def test_an_unknown_text_search_config_is_invalid_argument_naming_the_field(
    clients: Clients, config: str
) -> None:
    refused = await failure(clients.manager().create(new_ref(), FIXED, 32, text_search_config=config))
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.field_violations == ["text_search_config"]


async def test_text_search_over_a_corpus_is_stemmed_with_its_config(clients: Clients) -> None:
    manager = clients.manager()
    english, simple = new_ref(), new_ref()
    text = "Rollbacks of failed deployments are automatic.\n\nCaching layers sit in front of the database."
    for ref, config in ((english, "english"), (simple, "simple")):
        await manager.create(ref, FIXED, 16, text_search_config=config)
        await manager.upload(ref, "ops.md", text, content_type="text/plain")
    searcher = clients.searcher([english, simple])
    found = await searcher.search("how is a deployment rolled back", [english], mode=TEXT)
    assert [p.text_rank for p in found] == [1]
    assert "deployments" in found[0].text
    assert await searcher.search("how is a deployment rolled back", [simple], mode=TEXT) == []
    assert len(await searcher.search("deployments", [simple], mode=TEXT)) == 1


async def test_hybrid_search_lifts_the_chunk_next_to_a_strong_match(clients: Clients) -> None:
    manager = clients.manager()
    ref = new_ref()
    await manager.create(ref, RECURSIVE, 16)
    paragraphs = [
        "The payment service retries a failed charge three times with exponential backoff.",
        "After the third attempt the order moves to the manual review queue for the finance team.",
        *(f"Unrelated paragraph number {i} about office plants and lunch menus." for i in range(8)),
    ]
    await manager.upload(ref, "payments.md", "\n\n".join(paragraphs), content_type="text/plain")
    passages = await clients.searcher([ref]).search(
        "how often is a failed charge retried", [ref], mode=HYBRID
    )
    first, second = passages[0], passages[1]
    assert "retries a failed charge" in first.text
    assert second.chunk_index == first.chunk_index + 1  # the chunk after the match comes next
    assert "manual review queue" in second.text


@pytest.mark.parametrize("mode", [TEXT, HYBRID, common_pb2.SEARCH_MODE_VECTOR])
async def test_a_query_with_nul_is_invalid_argument_in_every_mode_not_internal(
    clients: Clients, mode: int
) -> None:
    manager = clients.manager()
    ref = new_ref()
    await manager.create(ref, FIXED, 32)
    await manager.upload(ref, "a.md", "some text to find", content_type="text/plain")
    refused = await failure(clients.searcher([ref]).search("some\x00text", [ref], mode=mode))
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.field_violations == ["query_text"]


@pytest.mark.parametrize(
    ("namespace", "ref", "field"), [("default\n", "kb-ok", "namespace"), ("default", "rt-nl\n", "ref")]
)
async def test_a_name_with_a_trailing_newline_is_invalid_argument_and_nothing_is_created(
    clients: Clients, namespace: str, ref: str, field: str
) -> None:
    refused = await failure(clients.manager(namespace=namespace).create(ref, FIXED, 32))
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.field_violations == [field]
    assert await failure(clients.manager().get(ref.strip())) is not None


async def test_a_display_name_with_nul_is_invalid_argument_not_internal(clients: Clients) -> None:
    refused = await failure(clients.manager().create(new_ref(), FIXED, 32, display_name="bad\x00name"))
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.field_violations == ["display_name"]
