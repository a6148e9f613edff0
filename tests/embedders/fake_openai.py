"""A real HTTP server on 127.0.0.1, in a thread, speaking the OpenAI embeddings API.

It can be told to fail the next requests with given statuses, to answer late, to require a bearer
key, or to send one of several kinds of broken response; it records every request it got.
A text's vector is the hash embedder's vector for it, scaled by 3 (so not unit length): a test
can compute exactly what the client must return.
"""

from __future__ import annotations

import base64
import json
import struct
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tokensvc.embedders import HashEmbedder

# How a successful answer is broken, if at all.
BROKEN_MODES = (
    "wrong_dimension",
    "nan",
    "infinite",
    "wrong_count",
    "duplicate_index",
    "missing_index",
    "string_values",
    "zero_vector",
    "not_json",
    "no_data",
)


@dataclass
class Request:
    path: str
    authorization: str | None
    body: dict[str, Any]


@dataclass
class FakeEmbeddings:
    dimension: int = 8
    # Statuses for the next requests, in order; None answers normally.
    failures: list[int | None] = field(default_factory=list)
    retry_after: str | None = None  # sent with failures
    delay_seconds: float = 0.0
    mode: str = "ok"  # "ok", "base64", or one of BROKEN_MODES
    expected_key: str | None = None  # when set, any other bearer gets 401
    requests: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._hash = HashEmbedder(dimension=self.dimension)
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                return None

            def do_POST(self) -> None:
                fake._handle(self)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.02,), daemon=True)
        self._thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    @property
    def batch_sizes(self) -> list[int]:
        return [len(request.body["input"]) for request in self.requests]

    @property
    def inputs(self) -> list[str]:
        return [text for request in self.requests for text in request.body["input"]]

    def vector(self, text: str) -> list[float]:
        return [float(x) * 3.0 for x in self._hash.vectorize([text])[0]]

    def stop(self) -> None:
        self._stopping.set()
        self._server.shutdown()
        self._server.server_close()

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("Content-Length", "0"))
        body = json.loads(handler.rfile.read(length) or b"{}")
        with self._lock:
            self.requests.append(Request(handler.path, handler.headers.get("Authorization"), body))
            failure = self.failures.pop(0) if self.failures else None
        if self.delay_seconds:
            self._stopping.wait(self.delay_seconds)
        if handler.path != "/v1/embeddings":
            self._send(handler, 404, {"error": {"message": "unknown route", "type": "not_found"}})
        elif (
            self.expected_key is not None
            and handler.headers.get("Authorization") != f"Bearer {self.expected_key}"
        ):
            self._send(handler, 401, {"error": {"message": "bad key", "type": "invalid_request_error"}})
        elif failure is not None:
            self._send(handler, failure, {"error": {"message": "try later", "type": "server_error"}})
        else:
            self._send(handler, 200, self._answer(body["input"]))

    def _answer(self, inputs: list[str]) -> Any:
        vectors: list[Any] = [self.vector(text) for text in inputs]
        indices = list(range(len(inputs)))
        mode = self.mode
        if mode == "base64":
            vectors = [self._hash_b64(vector) for vector in vectors]
        elif mode == "wrong_dimension":
            vectors[-1] = vectors[-1][:-1]
        elif mode in {"nan", "infinite"}:
            vectors[-1][0] = float("nan") if mode == "nan" else float("inf")
        elif mode == "string_values":
            vectors[-1] = [str(x) for x in vectors[-1]]
        elif mode == "zero_vector":
            vectors[-1] = [0.0] * self.dimension
        elif mode == "wrong_count":
            vectors, indices = vectors[:-1], indices[:-1]
        elif mode == "duplicate_index":
            indices[-1] = 0
        elif mode == "not_json":
            return b"<html>gateway</html>"
        elif mode == "no_data":
            return {"object": "list", "error": "nope"}
        data = [
            {"object": "embedding", "index": i, "embedding": v} for i, v in zip(indices, vectors, strict=True)
        ]
        if mode == "missing_index":
            del data[-1]["index"]
        data.reverse()  # out of order on purpose: the client must sort by index
        return {
            "object": "list",
            "data": data,
            "model": "fake",
            "usage": {"prompt_tokens": 1, "total_tokens": 1},
        }

    @staticmethod
    def _hash_b64(vector: list[float]) -> str:
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")

    def _send(self, handler: BaseHTTPRequestHandler, status: int, payload: Any) -> None:
        raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode("utf-8")
        try:
            handler.send_response(status)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(raw)))
            if status != 200 and self.retry_after is not None:
                handler.send_header("Retry-After", self.retry_after)
            handler.end_headers()
            handler.wfile.write(raw)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (a timeout test); nothing to answer
