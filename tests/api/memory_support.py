"""Helpers for the MemoryService end-to-end tests: launchers, capabilities, calls, the database.

Every test acts as its own, freshly certified agent (`agent-<8 hex>`) and looks at the shared
database only through that agent's buckets, so tests never depend on what else is stored.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import numpy as np
import pytest
from google.protobuf import duration_pb2

from tests.support import RpcFailure, SharedDatabase, dev_capability, failure_of, mtls_channel, superuser
from tokensvc.app import Service
from tokensvc.auth.devpki import DevPaths, issue_client_certificate
from tokensvc.v1 import capability_pb2, capability_pb2_grpc, common_pb2, memory_pb2, memory_pb2_grpc

__all__ = [
    "NAMESPACE",
    "Caller",
    "Launchers",
    "and_",
    "bucket_rows",
    "count_rows",
    "eq",
    "field_filter",
    "live_embeddings",
    "meta",
    "metadata_of",
    "pack",
    "remember_items",
    "snapshot",
    "ttl",
]

NAMESPACE = "default"
TRUST_DOMAIN = "dev.local"
TIMEOUT = 20.0

# --- wire values ------------------------------------------------------------------------------


def meta(value: str | float | bool) -> common_pb2.MetadataValue:
    if isinstance(value, bool):
        return common_pb2.MetadataValue(bool_value=value)
    if isinstance(value, str):
        return common_pb2.MetadataValue(string_value=value)
    return common_pb2.MetadataValue(number_value=float(value))


def metadata_of(memory: memory_pb2.Memory) -> dict[str, Any]:
    """A memory's metadata as plain Python scalars."""
    return {key: getattr(value, str(value.WhichOneof("kind"))) for key, value in memory.metadata.items()}


def ttl(seconds: int, nanos: int = 0) -> duration_pb2.Duration:
    return duration_pb2.Duration(seconds=seconds, nanos=nanos)


def remember_items(*contents: str, **metadata: str | float | bool) -> list[memory_pb2.RememberItem]:
    return [
        memory_pb2.RememberItem(content=c, metadata={k: meta(v) for k, v in metadata.items()})
        for c in contents
    ]


def field_filter(key: str, op: int, value: str | float | bool | None = None) -> common_pb2.Filter:
    leaf = common_pb2.FieldFilter(key=key, operator=common_pb2.FilterOperator.ValueType(op))
    if value is not None:
        leaf.value.CopyFrom(meta(value))
    return common_pb2.Filter(field=leaf)


def eq(key: str, value: str | float | bool) -> common_pb2.Filter:
    return field_filter(key, common_pb2.FILTER_OPERATOR_EQ, value)


def and_(*filters: common_pb2.Filter) -> common_pb2.Filter:
    return common_pb2.Filter(and_filters=common_pb2.FilterList(filters=list(filters)))


def pack(vector: Sequence[float] | np.ndarray) -> bytes:
    """A query vector as the wire wants it: packed little-endian float32."""
    return np.asarray(vector, dtype="<f4").tobytes()


# --- launchers and capabilities ---------------------------------------------------------------


@dataclass
class Caller:
    """One launcher (its certificate) calling with one capability; every RPC by name."""

    channel: grpc.aio.Channel
    token: str
    agent: str
    memory: memory_pb2_grpc.MemoryServiceStub = field(init=False)

    def __post_init__(self) -> None:
        self.memory = memory_pb2_grpc.MemoryServiceStub(self.channel)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),)

    async def call(self, rpc: str, request: Any) -> Any:
        return await getattr(self.memory, rpc)(request, metadata=self.metadata, timeout=TIMEOUT)

    async def fail(self, rpc: str, request: Any) -> RpcFailure:
        """Call an RPC that must fail; its decoded status."""
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await self.call(rpc, request)
        return failure_of(caught.value)

    async def remember(self, *items: memory_pb2.RememberItem | str) -> list[str]:
        request = memory_pb2.RememberRequest(
            items=[memory_pb2.RememberItem(content=i) if isinstance(i, str) else i for i in items]
        )
        response = await self.call("Remember", request)
        return [result.id for result in response.results]

    async def search(self, query: str | bytes, **fields: Any) -> list[memory_pb2.MemorySearchResult]:
        request = memory_pb2.SearchMemoriesRequest(**fields)
        if isinstance(query, bytes):
            request.query_vector = query
        else:
            request.query_text = query
        return list((await self.call("SearchMemories", request)).results)

    async def list_pages(self, page_size: int = 3, **fields: Any) -> list[list[memory_pb2.Memory]]:
        """Every page, following next_page_token until it comes back empty."""
        pages: list[list[memory_pb2.Memory]] = []
        token = ""
        for _ in range(10_000):
            request = memory_pb2.ListMemoriesRequest(page_size=page_size, page_token=token, **fields)
            page = await self.call("ListMemories", request)
            pages.append(list(page.memories))
            token = page.next_page_token
            if not token:
                return pages
        raise AssertionError("ListMemories never returned an empty next_page_token")

    async def list_all(self, page_size: int = 3, **fields: Any) -> list[memory_pb2.Memory]:
        return [memory for page in await self.list_pages(page_size, **fields) for memory in page]

    async def bucket(self) -> str:
        """The capability's bucket id, as VerifyCapability reports it."""
        stub = capability_pb2_grpc.CapabilityServiceStub(self.channel)
        response = await stub.VerifyCapability(
            capability_pb2.VerifyCapabilityRequest(), metadata=self.metadata, timeout=TIMEOUT
        )
        return str(response.scope.bucket_id)


class Launchers:
    """Opens callers for fresh agents against one service; closes every channel at the end."""

    def __init__(self, service: Service, dev: DevPaths, directory: Path):
        self._service = service
        self._dev = dev
        self._directory = directory
        self._channels: list[grpc.aio.Channel] = []
        self._certificates: dict[str, tuple[Path, Path]] = {}

    def new_agent(self) -> str:
        """A fresh agent name with a launcher certificate for it (namespace `default`)."""
        agent = f"agent-{uuid.uuid4().hex[:8]}"
        spiffe_id = f"spiffe://{TRUST_DOMAIN}/ns/{NAMESPACE}/sa/{agent}"
        self._certificates[agent] = issue_client_certificate(
            self._dev, spiffe_id, self._directory, name=agent
        )
        return agent

    def token(self, agent: str, *, user: str | None = None, per_user: bool = False, ltm: bool = True) -> str:
        return dev_capability(
            self._dev, namespace=NAMESPACE, agent=agent, user=user, per_user=per_user, long_term_memory=ltm
        )

    def caller(
        self,
        agent: str | None = None,
        *,
        user: str | None = None,
        per_user: bool = False,
        ltm: bool = True,
        service: Service | None = None,
    ) -> Caller:
        """A caller for `agent` (a fresh one when None) with a freshly minted capability."""
        agent = agent or self.new_agent()
        cert, key = self._certificates[agent]
        port = (service or self._service).port
        channel = mtls_channel(port, self._dev.ca_cert, cert, key)
        self._channels.append(channel)
        token = self.token(agent, user=user, per_user=per_user, ltm=ltm)
        return Caller(channel, token, agent)

    async def aclose(self) -> None:
        for channel in self._channels:
            await channel.close(grace=None)


# --- the database, seen by the superuser (no row-level security) ------------------------------


async def bucket_rows(conn: asyncpg.Connection, bucket: str) -> list[asyncpg.Record]:
    """Every row of a bucket, expired or not, oldest first."""
    return list(
        await conn.fetch(
            "SELECT id::text AS id, content, metadata::text AS metadata, idempotency_key, dimension, "
            "embedding, created_at, updated_at, expires_at FROM memories WHERE bucket = $1 "
            "ORDER BY created_at, id",
            bucket,
        )
    )


async def snapshot(database: SharedDatabase, agents: Iterable[str]) -> list[tuple[Any, ...]]:
    """Everything stored for these agents (their memories and their pinned spaces), comparable."""
    async with superuser(database) as conn:
        rows = await conn.fetch(
            "SELECT bucket, id::text, content, content_sha256, metadata::text, idempotency_key, "
            "embedding::text, created_at, updated_at, expires_at FROM memories "
            "WHERE namespace = $1 AND agent = ANY($2::text[]) ORDER BY bucket, id",
            NAMESPACE,
            list(agents),
        )
        spaces = await conn.fetch(
            "SELECT agent, embedder, model, dimension, normalized FROM memory_spaces "
            "WHERE namespace = $1 AND agent = ANY($2::text[]) ORDER BY agent",
            NAMESPACE,
            list(agents),
        )
    return [tuple(row) for row in rows] + [("space", *tuple(row)) for row in spaces]


async def count_rows(database: SharedDatabase, bucket: str) -> int:
    """Rows of a bucket in the table, expired or not."""
    async with superuser(database) as conn:
        return int(await conn.fetchval("SELECT count(*) FROM memories WHERE bucket = $1", bucket))


async def live_embeddings(database: SharedDatabase, bucket: str) -> tuple[list[str], np.ndarray, list[Any]]:
    """The live rows of a bucket as (ids, embedding matrix, metadata), for exact search in numpy."""
    async with superuser(database) as conn:
        rows = await conn.fetch(
            "SELECT id::text AS id, embedding, metadata::text AS metadata FROM memories "
            "WHERE bucket = $1 AND (expires_at IS NULL OR expires_at > now())",
            bucket,
        )
    matrix = np.stack([np.asarray(row["embedding"].to_numpy(), dtype=np.float64) for row in rows])
    return [row["id"] for row in rows], matrix, [json.loads(row["metadata"]) for row in rows]
