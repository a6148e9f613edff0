"""The load generator: a separate process that calls tokensvc, PostgreSQL and the peer.

tokensvc runs in the main benchmark process (with PostgreSQL in its own processes); everything
that plays "the caller" runs here, in a process of its own (spawned, so no state is inherited), the
way a launcher is a separate process in production. Each path is driven from here the same way, so
the comparison is what putting tokensvc between the caller and PostgreSQL costs:

- `service`: SearchMemories over mTLS gRPC with a per-user capability (a query vector, so no
  embedder runs), through one channel as a launcher would (or N connections, `--connections`);
- `raw_tenant`: the SQL tokensvc's store runs for that search, issued directly with asyncpg on a pool
  of the serving role: the same tenant transaction (BEGIN, the set_config statement row-level
  security reads, the search statement, COMMIT), the same routing (exact or HNSW by bucket size)
  and the same exact re-run when an approximate scan comes back short;
- `raw_bare`: the same search statement alone, one round trip, as the superuser (no row-level
  security to satisfy, HNSW settings fixed per session): the physical floor;
- `peer`: LangGraph's AsyncPostgresStore.asearch on the same vectors (bench/peer.py).

The main process sends commands over a pipe; each returns plain data (latencies, ids, counts).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import asyncpg
import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.dataset import DIM, FILTERS, K, make_dataset
from bench.load import binary_vectors
from bench.peer import PeerStore
from bench.workers import serve
from tokensvc.memory import Condition, Filter, Operator
from tokensvc.retrieval import SearchTuning, candidate_query
from tokensvc.storage.postgres import database as tokensvc_database
from tokensvc.storage.postgres.memories import search_statement
from tokensvc.storage.postgres.ranking import hnsw_settings
from tokensvc.storage.postgres.tenant import tenant_transaction
from tokensvc.storage.records import Tenant
from tokensvc.v1 import (
    capability_pb2,
    capability_pb2_grpc,
    common_pb2,
    knowledge_pb2,
    knowledge_pb2_grpc,
    memory_pb2,
    memory_pb2_grpc,
)

__all__ = ["SearchItem", "worker_main"]

TIMEOUT = 60.0


@dataclass(frozen=True)
class SearchItem:
    """One query as every path needs it."""

    n: int  # query number, unique within the run (the peer's query string is "q:<n>")
    bucket_id: str
    user: str
    size: int  # rows in the bucket (routing: exact when size <= threshold)
    filter: str
    vector: bytes  # little-endian float32
    token: str


def domain_filter(name: str) -> Filter | None:
    spec = FILTERS[name]
    return None if spec is None else Condition(spec[0], Operator.EQ, spec[1])


def proto_filter(name: str) -> common_pb2.Filter | None:
    spec = FILTERS[name]
    if spec is None:
        return None
    key, value = spec
    meta = (
        common_pb2.MetadataValue(bool_value=value)
        if isinstance(value, bool)
        else common_pb2.MetadataValue(string_value=value)
    )
    return common_pb2.Filter(
        field=common_pb2.FieldFilter(key=key, operator=common_pb2.FILTER_OPERATOR_EQ, value=meta)
    )


def mtls_channel(
    port: int, ca: bytes, cert: bytes, key: bytes, *, own_connection: bool = False
) -> grpc.aio.Channel:
    """An mTLS channel; `own_connection`: a subchannel pool of its own, so its TCP connection is
    not shared with another channel to the same target (gRPC shares them by default)."""
    credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    options = [("grpc.use_local_subchannel_pool", 1)] if own_connection else []
    return grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials, options=options)


async def run_concurrently(
    call: Callable[[Any], Awaitable[Any]], items: Sequence[Any], concurrency: int
) -> tuple[list[float], list[Any]]:
    """Every item through `call`, `concurrency` at a time; (latency ms, result) per item, in order."""
    latencies = [0.0] * len(items)
    results: list[Any] = [None] * len(items)
    pending = iter(range(len(items)))

    async def lane() -> None:
        for i in pending:
            began = time.perf_counter()
            results[i] = await call(items[i])
            latencies[i] = (time.perf_counter() - began) * 1000

    await asyncio.gather(*(lane() for _ in range(concurrency)))
    return latencies, results


class Worker:
    def __init__(self) -> None:
        self.channels: dict[str, grpc.aio.Channel] = {}
        # The service path's connections: the launcher channel, plus more with `connections` > 1.
        self.search_channels: list[grpc.aio.Channel] = []
        self.tenant_pool: asyncpg.Pool | None = None
        self.bare_pool: asyncpg.Pool | None = None
        self.peer: PeerStore | None = None
        self.tuning = SearchTuning()
        self.namespace = ""
        self.agent = ""
        self.conninfo: dict[str, dict[str, Any]] = {}

    # --- setup ----------------------------------------------------------------------------------

    async def setup(
        self,
        *,
        port: int,
        pki: dict[str, dict[str, bytes]],
        conninfo: dict[str, dict[str, Any]],
        pool_size: int,
        tuning: dict[str, int],
        namespace: str,
        agent: str,
        connections: int = 1,
    ) -> None:
        await self.close_channels()
        for role, files in pki.items():
            self.channels[role] = mtls_channel(port, files["ca"], files["cert"], files["key"])
        launcher = pki["launcher"]
        self.search_channels = [self.channels["launcher"]] + [
            mtls_channel(port, launcher["ca"], launcher["cert"], launcher["key"], own_connection=True)
            for _ in range(connections - 1)
        ]
        self.conninfo = conninfo
        self.tuning = SearchTuning(**tuning)
        self.namespace, self.agent = namespace, agent
        await self.close_pools()
        # The serving role, with tokensvc's own connection init (pgvector binary codec, jsonb).
        self.tenant_pool = await asyncpg.create_pool(
            **conninfo["app"],
            min_size=pool_size,
            max_size=pool_size,
            init=tokensvc_database._init_connection,
            server_settings={"search_path": "tokensvc, public"},
        )
        # The superuser (no row-level security), the approximate search's settings (tokensvc sets
        # them per transaction) as session defaults: startup parameters survive the RESET ALL a
        # pool runs when a connection is released.
        hnsw = hnsw_settings(ef_search=self._ef_search(), max_scan_tuples=self.tuning.max_scan_tuples)
        self.bare_pool = await asyncpg.create_pool(
            **conninfo["superuser"],
            min_size=pool_size,
            max_size=pool_size,
            init=tokensvc_database._init_connection,
            server_settings={"search_path": "tokensvc, public", **hnsw},
        )
        async with self.bare_pool.acquire() as conn:
            applied = {name: await conn.fetchval("SELECT current_setting($1)", name) for name in hnsw}
        if applied != hnsw:
            raise RuntimeError(f"the bare pool's HNSW settings did not apply: {applied}")

    async def open_peer(self, *, conninfo: str, pool_size: int) -> None:
        if self.peer is not None:
            await self.peer.close()
        self.peer = PeerStore(conninfo, pool_size)
        await self.peer.open()

    async def close_channels(self) -> None:
        for channel in [*self.channels.values(), *self.search_channels[1:]]:
            await channel.close(grace=None)
        self.channels.clear()
        self.search_channels = []

    async def close_pools(self) -> None:
        for pool in (self.tenant_pool, self.bare_pool):
            if pool is not None:
                await pool.close()
        self.tenant_pool = self.bare_pool = None

    async def close(self) -> None:
        await self.close_channels()
        await self.close_pools()
        if self.peer is not None:
            await self.peer.close()
            self.peer = None

    # --- search -----------------------------------------------------------------------------------

    def _exact(self, item: SearchItem) -> bool:
        """tokensvc's routing (the retrieval engine's RoutedPlan): by bucket size, higher with a filter."""
        return self.tuning.exact(item.size, filtered=FILTERS[item.filter] is not None, dimension=DIM)

    def _ef_search(self) -> int:
        return max(self.tuning.ef_search, 2 * K)

    def _statement(self, item: SearchItem, exact: bool) -> tuple[str, list[Any]]:
        vector = np.frombuffer(item.vector, dtype="<f4")
        query = candidate_query(
            vector=vector, text=None, k=K, rows=item.size, exact=exact, tuning=self.tuning
        )
        sql, params, _ = search_statement(item.bucket_id, query, domain_filter(item.filter))
        return sql, params

    async def search(self, path: str, items: list[dict[str, Any]], concurrency: int) -> dict[str, Any]:
        queries = [SearchItem(**item) for item in items]
        call = await self._search_call(path, queries)
        latencies, results = await run_concurrently(call, list(range(len(queries))), concurrency)
        return {"latencies_ms": latencies, "ids": results}

    async def _search_call(
        self, path: str, queries: list[SearchItem]
    ) -> Callable[[int], Awaitable[list[str]]]:
        if path == "service":
            # Query i goes over connection i mod N (one connection unless `connections` > 1).
            stubs = [memory_pb2_grpc.MemoryServiceStub(channel) for channel in self.search_channels]
            requests = []
            for item in queries:
                request = memory_pb2.SearchMemoriesRequest(query_vector=item.vector, top_k=K)
                if (f := proto_filter(item.filter)) is not None:
                    request.filter.CopyFrom(f)
                requests.append((request, (("authorization", f"Bearer {item.token}"),)))

            async def service(i: int) -> list[str]:
                request, metadata = requests[i]
                stub = stubs[i % len(stubs)]
                response = await stub.SearchMemories(request, metadata=metadata, timeout=TIMEOUT)
                return [result.memory.id for result in response.results]

            return service

        if path in ("raw_tenant", "raw_bare"):
            plans = []
            for item in queries:
                exact = self._exact(item)
                plans.append(
                    (
                        item,
                        exact,
                        self._statement(item, exact),
                        None if exact else self._statement(item, True),
                    )
                )
            tuning = self.tuning

            if path == "raw_bare":
                pool = self.bare_pool
                assert pool is not None

                async def bare(i: int) -> list[str]:
                    _, _, (sql, params), fallback = plans[i]
                    async with pool.acquire() as conn:
                        rows = await conn.fetch(sql, *params)
                        if fallback is not None and len(rows) < K:
                            rows = await conn.fetch(fallback[0], *fallback[1])
                    return [str(row["id"]) for row in rows]

                return bare

            tenant_pool = self.tenant_pool
            assert tenant_pool is not None
            hnsw = hnsw_settings(ef_search=self._ef_search(), max_scan_tuples=tuning.max_scan_tuples)

            async def tenant(i: int) -> list[str]:
                # PostgresMemoryStore.search's statements: BEGIN with the tenant's set_config
                # (with the HNSW settings when approximate), the search, [the exact re-run], COMMIT.
                item, exact, (sql, params), fallback = plans[i]
                scope = Tenant(self.namespace, self.agent, (item.bucket_id,))
                async with tenant_transaction(tenant_pool, scope, settings=None if exact else hnsw) as conn:
                    rows = await conn.fetch(sql, *params)
                    if fallback is not None and len(rows) < K:
                        rows = await conn.fetch(fallback[0], *fallback[1])
                return [str(row["id"]) for row in rows]

            return tenant

        if path == "peer":
            peer = self.peer
            assert peer is not None
            for item in queries:
                peer.register(f"q:{item.n}", np.frombuffer(item.vector, dtype="<f4"))

            async def peer_search(i: int) -> list[str]:
                item = queries[i]
                return await peer.search(item.user, f"q:{item.n}", item.filter, K)

            return peer_search
        raise ValueError(f"unknown search path {path!r}")

    # --- writes -------------------------------------------------------------------------------------

    async def remember(
        self, *, token: str, texts: list[str], metadata: list[dict[str, Any]], batch: int
    ) -> dict[str, Any]:
        """Remember every text through the service in batches; the rows/s of the whole run."""
        stub = memory_pb2_grpc.MemoryServiceStub(self.channels["launcher"])
        requests = []
        for start in range(0, len(texts), batch):
            items = []
            for text, meta in zip(texts[start : start + batch], metadata[start : start + batch], strict=True):
                values = {
                    key: common_pb2.MetadataValue(bool_value=value)
                    if isinstance(value, bool)
                    else common_pb2.MetadataValue(number_value=float(value))
                    if isinstance(value, int | float)
                    else common_pb2.MetadataValue(string_value=str(value))
                    for key, value in meta.items()
                }
                items.append(memory_pb2.RememberItem(content=text, metadata=values))
            requests.append(memory_pb2.RememberRequest(items=items))
        auth = (("authorization", f"Bearer {token}"),)
        latencies = []
        began = time.perf_counter()
        stored = 0
        for request in requests:
            t0 = time.perf_counter()
            response = await stub.Remember(request, metadata=auth, timeout=TIMEOUT)
            latencies.append((time.perf_counter() - t0) * 1000)
            stored += sum(not result.deduplicated for result in response.results)
        elapsed = time.perf_counter() - began
        return {"rows": stored, "seconds": elapsed, "batch_ms": latencies}

    async def copy(
        self, *, table: str, rows: list[tuple[Any, ...]], vectors: bytes, columns: list[str]
    ) -> dict[str, Any]:
        """Binary COPY of these rows (their vectors pre-encoded, untimed) into `table` as the superuser."""
        matrix = np.frombuffer(vectors, dtype="<f4").reshape(-1, DIM)
        encoded = binary_vectors(matrix)
        records = [(*row, encoded[i]) for i, row in enumerate(rows)]
        schema, name = table.split(".")
        conn = await copy_connection_from(self.conninfo["superuser"])
        try:
            began = time.perf_counter()
            await conn.copy_records_to_table(name, schema_name=schema, records=records, columns=columns)
            elapsed = time.perf_counter() - began
        finally:
            await conn.close()
        return {"rows": len(records), "seconds": elapsed}

    async def peer_puts(
        self, *, scale: str, seed: int, pairs: list[tuple[int, int]], batch: int
    ) -> dict[str, Any]:
        """The peer's own writes: `abatch` of PutOps, `batch` at a time; rows/s of the whole run."""
        assert self.peer is not None
        data = make_dataset(scale, seed=seed)
        began = time.perf_counter()
        for start in range(0, len(pairs), batch):
            await self.peer.put_bucket_batch(data, pairs[start : start + batch])
        return {"rows": len(pairs), "seconds": time.perf_counter() - began}

    # --- knowledge and capabilities -------------------------------------------------------------

    async def upload(
        self, *, namespace: str, ref: str, documents: list[str], chunk_size: int
    ) -> dict[str, Any]:
        stub = knowledge_pb2_grpc.KnowledgeServiceStub(self.channels["control-plane"])
        await stub.CreateKnowledgeBase(
            knowledge_pb2.CreateKnowledgeBaseRequest(
                namespace=namespace,
                ref=ref,
                embedder="hash",
                chunking=knowledge_pb2.ChunkingStrategy(
                    kind=knowledge_pb2.CHUNKING_KIND_MARKDOWN, chunk_size=chunk_size
                ),
            ),
            timeout=TIMEOUT,
        )
        chunks = 0
        size = 0
        per_document = []
        began = time.perf_counter()
        for d, text in enumerate(documents):
            body = text.encode()
            size += len(body)
            parts = [
                knowledge_pb2.UploadDocumentRequest(
                    header=knowledge_pb2.UploadDocumentHeader(
                        namespace=namespace,
                        knowledge_base_ref=ref,
                        document_ref=f"doc-{d}",
                        content_type="text/markdown",
                        wait_until_ready=True,
                    )
                ),
                *(
                    knowledge_pb2.UploadDocumentRequest(content=body[i : i + (1 << 20)])
                    for i in range(0, len(body), 1 << 20)
                ),
            ]
            t0 = time.perf_counter()
            response = await stub.UploadDocument(iter(parts), timeout=TIMEOUT * 5)
            per_document.append((time.perf_counter() - t0) * 1000)
            chunks += response.chunk_count
        return {
            "chunks": chunks,
            "bytes": size,
            "seconds": time.perf_counter() - began,
            "document_ms": per_document,
        }

    async def health(self, *, calls: int) -> dict[str, Any]:
        """grpc.health.v1 Check over the same mTLS channel: a round trip with nothing behind it."""
        stub = health_pb2_grpc.HealthStub(self.channels["launcher"])
        request = health_pb2.HealthCheckRequest()

        async def call(_: int) -> None:
            await stub.Check(request, timeout=TIMEOUT)

        latencies, _ = await run_concurrently(call, list(range(calls)), 1)
        return {"latencies_ms": latencies}

    async def verify(self, *, tokens: list[str]) -> dict[str, Any]:
        """VerifyCapability once per token, one at a time; latency per call."""
        stub = capability_pb2_grpc.CapabilityServiceStub(self.channels["launcher"])
        request = capability_pb2.VerifyCapabilityRequest()

        async def call(token: str) -> None:
            await stub.VerifyCapability(
                request, metadata=(("authorization", f"Bearer {token}"),), timeout=TIMEOUT
            )

        latencies, _ = await run_concurrently(call, tokens, 1)
        return {"latencies_ms": latencies}


async def copy_connection_from(conninfo: dict[str, Any]) -> asyncpg.Connection:
    conn = await asyncpg.connect(**conninfo, server_settings={"search_path": "tokensvc, public"})
    await conn.set_type_codec(
        "vector", schema="public", encoder=lambda v: v, decoder=lambda v: v, format="binary"
    )
    return conn


def worker_main(pipe: Connection) -> None:
    """Entry point of the spawned load-generator process."""
    serve(pipe, Worker)
