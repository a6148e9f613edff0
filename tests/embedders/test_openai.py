"""The `openai` embedder against a real HTTP server on loopback: batching, retries, validation, keys."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.embedders.fake_openai import BROKEN_MODES, FakeEmbeddings
from tokensvc.embedders import Embedder, HashEmbedder, OpenAIEmbedder
from tokensvc.errors import EmbedderUnavailable, Reason

KEY = "sk-test-Zq81-very-secret-key"
DIMENSION = 8

Factory = Callable[..., OpenAIEmbedder]


@pytest.fixture
def server() -> Iterator[FakeEmbeddings]:
    fake = FakeEmbeddings(dimension=DIMENSION)
    yield fake
    fake.stop()


@pytest.fixture
async def make(server: FakeEmbeddings) -> AsyncIterator[Factory]:
    """Build embedders pointed at the fake server; all are closed afterwards."""
    made: list[OpenAIEmbedder] = []

    def factory(**overrides: Any) -> OpenAIEmbedder:
        options: dict[str, Any] = {
            "name": "remote",
            "base_url": server.base_url,
            "model": "fake-model",
            "dimension": DIMENSION,
            "backoff_seconds": 0.01,
            "timeout_seconds": 5.0,
        }
        embedder = OpenAIEmbedder(**{**options, **overrides})
        made.append(embedder)
        return embedder

    yield factory
    for embedder in made:
        await embedder.aclose()


def expected(texts: list[str]) -> np.ndarray:
    return HashEmbedder(dimension=DIMENSION).vectorize(texts)


def test_openai_embedder_satisfies_the_embedder_protocol(make: Factory) -> None:
    assert isinstance(make(), Embedder)


async def test_documents_are_sent_in_batches_and_returned_in_input_order(
    make: Factory, server: FakeEmbeddings
) -> None:
    texts = [f"fact number {i} about topic {i % 3}" for i in range(10)]
    vectors = await make(batch_size=4).embed_documents(texts)
    assert server.batch_sizes == [4, 4, 2]
    assert vectors.shape == (10, DIMENSION)
    assert vectors.dtype == np.float32
    assert vectors.flags.c_contiguous
    np.testing.assert_allclose(vectors, expected(texts), atol=1e-6)  # sorted by index, normalised
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-6)


async def test_request_names_the_model_asks_for_floats_and_applies_prefixes(
    make: Factory, server: FakeEmbeddings
) -> None:
    embedder = make(document_prefix="passage: ", query_prefix="query: ")
    documents = await embedder.embed_documents(["cats purr", "dogs bark"])
    query = await embedder.embed_query("which animal purrs")
    assert server.inputs == ["passage: cats purr", "passage: dogs bark", "query: which animal purrs"]
    assert all(
        r.body["model"] == "fake-model" and r.body["encoding_format"] == "float" for r in server.requests
    )
    assert all("input_type" not in r.body for r in server.requests)
    assert server.requests[0].path == "/v1/embeddings"
    assert query.shape == (DIMENSION,)
    np.testing.assert_allclose(documents, expected(["passage: cats purr", "passage: dogs bark"]), atol=1e-6)
    np.testing.assert_allclose(query, expected(["query: which animal purrs"])[0], atol=1e-6)


async def test_input_type_is_sent_when_configured(make: Factory, server: FakeEmbeddings) -> None:
    embedder = make(document_input_type="passage", query_input_type="query")
    await embedder.embed_documents(["a"])
    await embedder.embed_query("b")
    assert [r.body["input_type"] for r in server.requests] == ["passage", "query"]
    assert server.inputs == ["a", "b"]


async def test_empty_document_list_sends_nothing(make: Factory, server: FakeEmbeddings) -> None:
    vectors = await make().embed_documents([])
    assert vectors.shape == (0, DIMENSION)
    assert server.requests == []


async def test_base64_embeddings_are_accepted(make: Factory, server: FakeEmbeddings) -> None:
    server.mode = "base64"
    np.testing.assert_allclose(await make().embed_documents(["x y"]), expected(["x y"]), atol=1e-6)


async def test_unnormalised_embedder_returns_the_endpoint_vectors(
    make: Factory, server: FakeEmbeddings
) -> None:
    vectors = await make(normalized=False).embed_documents(["one two"])
    np.testing.assert_allclose(vectors, expected(["one two"]) * 3.0, atol=1e-5)
    assert make(normalized=False).spec.normalized is False


async def test_503_and_429_are_retried_until_success(make: Factory, server: FakeEmbeddings) -> None:
    server.failures = [503, 429, 500]
    vectors = await make(max_retries=3).embed_documents(["survives"])
    assert len(server.requests) == 4
    np.testing.assert_allclose(vectors, expected(["survives"]), atol=1e-6)


async def test_retry_after_is_honoured(make: Factory, server: FakeEmbeddings) -> None:
    server.failures = [429]
    server.retry_after = "0.3"
    started = time.monotonic()
    await make(max_retries=1).embed_documents(["x"])
    assert time.monotonic() - started >= 0.3


async def test_gives_up_after_max_retries(make: Factory, server: FakeEmbeddings) -> None:
    server.failures = [503] * 10
    with pytest.raises(EmbedderUnavailable) as caught:
        await make(max_retries=2).embed_documents(["x"])
    assert len(server.requests) == 3
    assert caught.value.reason is Reason.EMBEDDER_UNAVAILABLE
    assert "after 3 attempts (HTTP 503)" in caught.value.message


@pytest.mark.parametrize("status", [400, 401, 404, 422])
async def test_other_4xx_is_not_retried(make: Factory, server: FakeEmbeddings, status: int) -> None:
    server.failures = [status] * 5
    with pytest.raises(EmbedderUnavailable, match=f"refused the request \\(HTTP {status}\\)"):
        await make(max_retries=3).embed_documents(["x"])
    assert len(server.requests) == 1


async def test_a_slow_endpoint_times_out_as_unavailable(make: Factory, server: FakeEmbeddings) -> None:
    server.delay_seconds = 5.0
    started = time.monotonic()
    with pytest.raises(EmbedderUnavailable, match=r"no answer within 0\.2 s"):
        await make(timeout_seconds=0.2, max_retries=1).embed_query("slow")
    assert time.monotonic() - started < 2.0
    assert len(server.requests) == 2  # timeouts are retried


async def test_connection_refused_is_retried_then_unavailable(make: Factory, server: FakeEmbeddings) -> None:
    base_url = server.base_url
    server.stop()
    with pytest.raises(EmbedderUnavailable, match="connection failed"):
        await make(base_url=base_url, max_retries=2).embed_query("nobody home")


@pytest.mark.parametrize("mode", BROKEN_MODES)
async def test_invalid_responses_are_unavailable_and_not_retried(
    make: Factory, server: FakeEmbeddings, mode: str
) -> None:
    server.mode = mode
    with pytest.raises(EmbedderUnavailable, match="invalid response from the endpoint") as caught:
        await make(max_retries=3).embed_documents(["alpha beta", "gamma delta", "epsilon"])
    assert len(server.requests) == 1
    assert "remote" in caught.value.message


async def test_a_failed_later_batch_returns_nothing_at_all(make: Factory, server: FakeEmbeddings) -> None:
    embedder = make(batch_size=2, max_retries=0)
    first = await embedder.embed_documents(["a", "b"])  # the endpoint works...
    assert first.shape == (2, DIMENSION)
    server.requests.clear()
    server.failures = [None, 400]  # ...then the second batch of the next call is refused
    with pytest.raises(EmbedderUnavailable):
        await embedder.embed_documents(["a", "b", "c", "d", "e"])
    assert server.batch_sizes == [2, 2]


async def test_authorization_is_the_key_from_the_file_and_follows_rotation(
    make: Factory, server: FakeEmbeddings, tmp_path: Path
) -> None:
    key_file = tmp_path / "api-key"
    key_file.write_text(KEY + "\n")
    server.expected_key = KEY
    embedder = make(api_key_file=key_file)
    await embedder.embed_query("first")
    assert server.requests[-1].authorization == f"Bearer {KEY}"

    rotated = tmp_path / "api-key.new"
    rotated.write_text("sk-rotated-key-2")
    rotated.replace(key_file)  # how a mounted secret changes: a new file swapped in
    server.expected_key = "sk-rotated-key-2"
    await embedder.embed_query("second")
    assert server.requests[-1].authorization == "Bearer sk-rotated-key-2"


async def test_missing_key_file_is_unavailable_without_calling_the_endpoint(
    make: Factory, server: FakeEmbeddings, tmp_path: Path
) -> None:
    with pytest.raises(EmbedderUnavailable, match="API key file is unusable"):
        await make(api_key_file=tmp_path / "absent").embed_query("x")
    assert server.requests == []


async def test_key_never_appears_in_repr_errors_or_logs(
    make: Factory, server: FakeEmbeddings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    key_file = tmp_path / "api-key"
    key_file.write_text(KEY)
    server.expected_key = "a-different-key"  # every request is refused with 401
    embedder = make(api_key_file=key_file)
    caplog.set_level(logging.DEBUG)
    with pytest.raises(EmbedderUnavailable) as caught:
        await embedder.embed_query("x")
    server.expected_key = None
    server.failures = [503]
    await embedder.embed_query("x")  # a retry is logged too

    assert server.requests[0].authorization == f"Bearer {KEY}"
    assert str(key_file) in repr(embedder)
    shown = [repr(embedder), str(embedder), str(caught.value), repr(caught.value), caplog.text]
    shown += [repr(record.__dict__) for record in caplog.records]
    assert caplog.records, "the failures were logged"
    assert not [text for text in shown if KEY in text]


def test_bad_construction_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="without credentials"):
        OpenAIEmbedder(name="x", base_url="http://user:pw@127.0.0.1/v1", model="m", dimension=4)
    with pytest.raises(ValueError, match="batch_size"):
        OpenAIEmbedder(name="x", base_url="http://127.0.0.1/v1", model="m", dimension=4, batch_size=0)
