"""The edge's own CPU per call, in process: no network, no gRPC core, no database.

    .venv/bin/python -m bench.edge [--calls 20000]
    PYTHONPATH=OTHER_TREE .venv/bin/python bench/edge.py   # the same against another tree

Drives `EdgeInterceptor` the way grpc.aio does for a unary RPC (intercept_service, then the
returned handler with a request and a servicer context) around a servicer that answers at once,
with a launcher certificate, a capability (a stub authenticator: its cost is not the edge's), the
JSON log line written to /dev/null and the metrics, and reports microseconds of CPU
(`time.process_time`) per call, best of `--repeat` runs; then the same for one protobuf
Timestamp from a datetime (api/convert.timestamp: two or three per memory in an answer).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc

from tokensvc.api.edge import EdgeInterceptor
from tokensvc.api.policy import POLICIES
from tokensvc.auth.devpki import DEV_TRUST_DOMAIN, ensure_dev_material
from tokensvc.auth.identity import Caller, IdentityPolicy
from tokensvc.auth.scope import TenantScope
from tokensvc.logs import configure_logging
from tokensvc.v1 import memory_pb2

METHOD = "/tokensvc.v1.MemoryService/SearchMemories"


class _Details:
    def __init__(self, method: str, metadata: tuple[tuple[str, str], ...]):
        self.method = method
        self.invocation_metadata = metadata


class _Context:
    """What the edge reads from grpc.aio's ServicerContext."""

    def __init__(self, pem: bytes, metadata: tuple[tuple[str, str], ...]):
        self._auth = {"x509_pem_cert": [pem], "transport_security_type": [b"ssl"]}
        self._metadata = metadata

    def auth_context(self) -> dict[str, list[bytes]]:
        return dict(self._auth)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float:
        return 30.0


class _Authenticator:
    def __init__(self, scope: TenantScope):
        self._scope = scope

    async def authenticate(self, token: str, caller: Caller) -> TenantScope:
        return self._scope


def _scope() -> TenantScope:
    fields: dict[str, Any] = {
        "namespace": "default",
        "agent": "dev-agent",
        "bucket_id": "b" * 43,
        "previous_bucket_ids": (),
        "agent_bucket_id": "b" * 43,
        "per_user": True,
        "registry": None,
        "long_term_memory": True,
        "knowledge_bases": (),
        "run_id": "run-1",
        "jti": "jti-1",
        "issued_at": 0,
        "expires_at": 2**31,
    }
    names = TenantScope.__dataclass_fields__  # the fields this tree's TenantScope has
    return TenantScope(**{k: v for k, v in fields.items() if k in names})


async def measure(calls: int, repeat: int) -> float:
    dev = ensure_dev_material(Path(tempfile.mkdtemp(prefix="tokensvc-bench-edge-")))
    cert, _ = dev.client("launcher")
    identities = IdentityPolicy(
        trust_domain=DEV_TRUST_DOMAIN,
        launcher_template="spiffe://{trust_domain}/ns/{namespace}/sa/{agent}",
        admin_ids=(),
        control_plane_ids=(),
    )
    edge = EdgeInterceptor(identities, _Authenticator(_scope()), POLICIES)
    metadata = (
        ("user-agent", "grpc-python-asyncio/1.85.3 grpc-c/52.0.0 (linux; chttp2)"),
        ("authorization", "Bearer " + "e" * 600),
    )
    context = _Context(cert.read_bytes(), metadata)

    async def servicer(request: Any, context: Any) -> memory_pb2.SearchMemoriesResponse:
        return memory_pb2.SearchMemoriesResponse()

    inner = grpc.unary_unary_rpc_method_handler(
        servicer,
        request_deserializer=memory_pb2.SearchMemoriesRequest.FromString,
        response_serializer=memory_pb2.SearchMemoriesResponse.SerializeToString,
    )

    async def continuation(details: Any) -> Any:
        return inner

    request = memory_pb2.SearchMemoriesRequest(query_text="which runner pool", top_k=10)
    best = float("inf")
    for _ in range(repeat):
        began = time.process_time()
        for _ in range(calls):
            handler = await edge.intercept_service(continuation, _Details(METHOD, metadata))  # type: ignore[arg-type]
            await handler.unary_unary(request, context)
        best = min(best, (time.process_time() - began) / calls * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    configure_logging("INFO")
    handler = logging.getLogger().handlers[0]
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(open("/dev/null", "w"))  # noqa: SIM115 - for the life of the process
    edge = asyncio.run(measure(args.calls, args.repeat))
    print(f"edge: {edge:.1f} us CPU per call")
    print(f"timestamp: {measure_timestamps(args.calls, args.repeat):.2f} us CPU per conversion")


def measure_timestamps(calls: int, repeat: int) -> float:
    """api/convert.timestamp on an aware datetime (two or three per memory in an answer)."""
    from tokensvc.api.convert import timestamp

    value = datetime.now(UTC)
    best = float("inf")
    for _ in range(repeat):
        began = time.process_time()
        for _ in range(calls):
            timestamp(value)
        best = min(best, (time.process_time() - began) / calls * 1e6)
    return best


if __name__ == "__main__":
    main()
