"""The built-in `hash` embedder: deterministic, unit length, never NaN, and word overlap scores higher."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tokensvc.embedders import HASH_MODEL, Embedder, EmbedderSpec, HashEmbedder

TEXTS = [
    "The deploy pipeline runs every night at two",
    "Résumé of Zoë's café visit — ÉTÉ 2024",
    "用户喜欢绿茶",
    "",
]


def test_spec_is_pinned_with_a_versioned_model() -> None:
    assert HashEmbedder().spec == EmbedderSpec(name="hash", model="hash-v1", dimension=384, normalized=True)
    assert HashEmbedder(name="small", dimension=64).spec.dimension == 64
    assert HASH_MODEL == "hash-v1"
    assert isinstance(HashEmbedder(), Embedder)


async def test_documents_are_float32_unit_rows_in_a_contiguous_matrix() -> None:
    vectors = await HashEmbedder().embed_documents(TEXTS)
    assert vectors.shape == (len(TEXTS), 384)
    assert vectors.dtype == np.float32
    assert vectors.flags.c_contiguous
    assert np.isfinite(vectors).all()
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-6)


async def test_query_is_one_vector_equal_to_the_document_vector() -> None:
    embedder = HashEmbedder()
    query = await embedder.embed_query(TEXTS[0])
    assert query.shape == (384,)
    assert query.dtype == np.float32
    np.testing.assert_array_equal(query, (await embedder.embed_documents([TEXTS[0]]))[0])


@pytest.mark.parametrize("text", ["", "   ", "!!! ... ---", "\n\t"])
async def test_text_without_tokens_gets_a_fixed_finite_unit_vector(text: str) -> None:
    embedder = HashEmbedder()
    vector = await embedder.embed_query(text)
    assert np.isfinite(vector).all()
    assert np.linalg.norm(vector) == pytest.approx(1.0)
    np.testing.assert_array_equal(vector, await embedder.embed_query(""))
    assert np.count_nonzero(vector) == 1  # the reserved feature


async def test_shared_words_score_higher_than_unrelated_text() -> None:
    embedder = HashEmbedder()
    query = await embedder.embed_query("which database does production use")
    related, partly, unrelated = await embedder.embed_documents(
        [
            "production uses the PostgreSQL database in Frankfurt",
            "the staging database is small",
            "my cat likes tuna and long naps",
        ]
    )
    assert float(query @ related) > float(query @ partly) > float(query @ unrelated)


async def test_word_pairs_make_order_matter() -> None:
    embedder = HashEmbedder()
    a, b, c = await embedder.embed_documents(["dog bites man", "man bites dog", "dog bites man"])
    np.testing.assert_array_equal(a, c)
    assert float(a @ b) < 0.99  # same words, different pairs


async def test_case_and_unicode_forms_do_not_change_the_vector() -> None:
    vectors = await HashEmbedder().embed_documents(
        ["Café ÉTÉ", "café été", "Cafe\u0301 e\u0301te\u0301", "ＣＡＦÉ ÉTÉ"]
    )
    for vector in vectors[1:]:
        np.testing.assert_array_equal(vector, vectors[0])


async def test_large_batches_hashed_in_a_thread_match_the_inline_result() -> None:
    embedder = HashEmbedder()
    texts = [f"memory {i} " + "word " * 200 for i in range(64)]  # above the thread threshold
    np.testing.assert_array_equal(await embedder.embed_documents(texts), embedder.vectorize(texts))


def test_vectors_are_identical_in_another_process_with_another_hash_seed() -> None:
    script = (
        "import json, sys; from tokensvc.embedders import HashEmbedder;"
        "texts = json.loads(sys.stdin.read());"
        "print(json.dumps(HashEmbedder().vectorize(texts).tolist()))"
    )
    results = []
    for seed in ("1", "2"):
        completed = subprocess.run(
            [sys.executable, "-c", script],
            input=json.dumps(TEXTS),
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
            timeout=60,
        )
        results.append(np.asarray(json.loads(completed.stdout), dtype=np.float32))
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0], HashEmbedder().vectorize(TEXTS))


def test_hash_v1_is_frozen() -> None:
    """If this fails the algorithm changed: bump HASH_MODEL so pinned spaces refuse old vectors."""
    vector = HashEmbedder(dimension=64).vectorize(["Hello hello world"])[0]
    slots = {int(i): round(float(vector[i]), 4) for i in np.flatnonzero(vector)}
    assert slots == GOLDEN_HELLO_WORLD


# hello (tf 2 -> 1 + ln 2), world, 'hello hello', 'hello world': four slots, norm 1.
GOLDEN_HELLO_WORLD = {21: -0.4129, 27: -0.4129, 33: 0.4129, 45: 0.699}
