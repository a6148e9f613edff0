"""Tracing end to end: an RPC's spans continue the caller's W3C trace and carry no secrets.

An in-memory exporter is added to the process's tracer provider; a launcher sends `traceparent`
metadata, and the spans of that trace are checked as a tree: the server span is the caller's
child, and `capability.verify`, `memory.search`, `embed` and the asyncpg spans hang below it.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.api.knowledge_support import open_clients
from tests.api.memory_support import Caller, Launchers
from tokensvc.app import Service
from tokensvc.auth.devpki import DevPaths
from tokensvc.observability import configure_tracing
from tokensvc.v1 import knowledge_pb2, memory_pb2

SEARCH_METHOD = "/tokensvc.v1.MemoryService/SearchMemories"
KNOWLEDGE_METHOD = "/tokensvc.v1.KnowledgeService/SearchKnowledge"
USER_ID = "user-7b1e-trace-canary@example.com"
CONTENTS = (
    "the canary password for the blue vault is heliotrope-3141",
    "quarterly tide tables mention heliotrope moorings",
)


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    spans = InMemorySpanExporter()
    configure_tracing(None, extra_processor=SimpleSpanProcessor(spans))
    yield spans
    spans.shutdown()  # the provider keeps the processor; a stopped exporter drops what it gets


@pytest.fixture
def spans(exporter: InMemorySpanExporter) -> InMemorySpanExporter:
    exporter.clear()
    return exporter


def traceparent() -> tuple[int, int, str]:
    trace_id, span_id = secrets.randbits(128) | 1, secrets.randbits(64) | 1
    return trace_id, span_id, f"00-{trace_id:032x}-{span_id:016x}-01"


async def trace_of(exporter: InMemorySpanExporter, trace_id: int, root_name: str) -> list[ReadableSpan]:
    """The finished spans of one trace, once its server span has ended (bounded wait)."""
    for _ in range(100):
        found = [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]
        if any(s.name == root_name for s in found):
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"no finished {root_name} span in trace {trace_id:032x}")


def parent_id(span: ReadableSpan) -> int | None:
    return None if span.parent is None else span.parent.span_id


def ancestors(span: ReadableSpan, by_id: dict[int, ReadableSpan]) -> list[str]:
    """Names from the span's parent up to the root of what this process recorded."""
    names: list[str] = []
    current = by_id.get(parent_id(span) or 0)
    while current is not None:
        names.append(current.name)
        current = by_id.get(parent_id(current) or 0)
    return names


def is_database(span: ReadableSpan) -> bool:
    return (span.attributes or {}).get("db.system") == "postgresql" or (
        (span.attributes or {}).get("db.system.name") == "postgresql"
    )


def span_tree(spans: Sequence[ReadableSpan]) -> list[dict[str, Any]]:
    """The spans as nested JSON-able dicts, roots (spans whose parent is not here) first."""
    by_parent: dict[int | None, list[ReadableSpan]] = {}
    ids = {s.context.span_id for s in spans}
    for span in sorted(spans, key=lambda s: s.start_time or 0):
        parent = parent_id(span)
        by_parent.setdefault(parent if parent in ids else None, []).append(span)

    def node(span: ReadableSpan) -> dict[str, Any]:
        return {
            "name": span.name,
            "kind": span.kind.name,
            "trace_id": f"{span.context.trace_id:032x}",
            "span_id": f"{span.context.span_id:016x}",
            "parent_span_id": None if span.parent is None else f"{span.parent.span_id:016x}",
            "duration_ms": round(((span.end_time or 0) - (span.start_time or 0)) / 1e6, 3),
            "status": span.status.status_code.name,
            "attributes": dict(span.attributes or {}),
            "children": [node(child) for child in by_parent.get(span.context.span_id, [])],
        }

    return [node(root) for root in by_parent.get(None, [])]


def assert_nothing_secret(spans: Sequence[ReadableSpan], secrets_: Sequence[str]) -> None:
    """No span name, attribute key or value, event or status text contains any of `secrets_`."""
    for span in spans:
        texts = [span.name, span.status.description or ""]
        for key, value in (span.attributes or {}).items():
            texts += [key, json.dumps(value, default=str)]
        for event in span.events:
            texts.append(event.name)
            texts += [json.dumps(v, default=str) for v in (event.attributes or {}).values()]
        for text in texts:
            for secret in secrets_:
                assert secret not in text, f"span {span.name!r} carries a secret"


async def search_with_trace(caller: Caller, header: str) -> memory_pb2.SearchMemoriesResponse:
    request = memory_pb2.SearchMemoriesRequest(query_text="heliotrope", top_k=5)
    return await caller.memory.SearchMemories(
        request, metadata=(*caller.metadata, ("traceparent", header)), timeout=20
    )


async def test_search_memories_spans_nest_under_the_callers_trace(
    spans: InMemorySpanExporter, launchers: Launchers, tmp_path: Path
) -> None:
    caller = launchers.caller(user=USER_ID, per_user=True)
    await caller.remember(*CONTENTS)
    bucket = await caller.bucket()
    trace_id, client_span_id, header = traceparent()

    response = await search_with_trace(caller, header)
    assert len(response.results) == 2

    found = await trace_of(spans, trace_id, SEARCH_METHOD)
    by_id = {s.context.span_id: s for s in found}
    (server,) = [s for s in found if s.name == SEARCH_METHOD]
    assert server.kind.name == "SERVER"
    assert server.parent is not None
    assert server.parent.span_id == client_span_id
    assert server.parent.is_remote
    assert server.attributes is not None
    assert server.attributes["tokensvc.namespace"] == "default"
    assert server.attributes["tokensvc.agent"] == caller.agent
    assert server.attributes["tokensvc.bucket"] == bucket
    assert server.attributes["rpc.grpc.status_code"] == 0

    def named(name: str) -> list[ReadableSpan]:
        return [s for s in found if s.name == name]

    (verify,) = named("capability.verify")
    (search,) = named("memory.search")
    assert parent_id(verify) == server.context.span_id
    assert parent_id(search) == server.context.span_id
    assert search.attributes is not None
    assert search.attributes["tokensvc.namespace"] == "default"
    assert search.attributes["tokensvc.agent"] == caller.agent
    assert search.attributes["tokensvc.bucket"] == bucket
    assert search.attributes["tokensvc.result_count"] == 2
    (embed,) = named("embed")
    assert ancestors(embed, by_id)[:2] == ["memory.search", SEARCH_METHOD]
    database = [s for s in found if is_database(s)]
    assert database, "no asyncpg span in the trace"
    for span in database:
        assert span.kind.name == "CLIENT"
        assert ancestors(span, by_id)[-1] == SEARCH_METHOD
    assert any("memory.search" in ancestors(span, by_id) for span in database)
    # Every span this process recorded for the call is the server span or below it.
    assert all(s is server or SEARCH_METHOD in ancestors(s, by_id) for s in found)

    assert_nothing_secret(spans.get_finished_spans(), [*CONTENTS, caller.token, USER_ID])

    tree = span_tree(found)
    exported = tmp_path / "search_memories_trace.json"
    exported.write_text(json.dumps(tree, indent=2, default=str))
    print(f"\nSearchMemories trace ({exported}):\n{exported.read_text()}")
    reread = json.loads(exported.read_text())
    assert len(reread) == 1
    root = reread[0]
    assert root["name"] == SEARCH_METHOD
    assert root["trace_id"] == f"{trace_id:032x}"
    assert root["parent_span_id"] == f"{client_span_id:016x}"
    child_names = {child["name"] for child in root["children"]}
    assert {"capability.verify", "memory.search"} <= child_names
    (search_node,) = [c for c in root["children"] if c["name"] == "memory.search"]
    assert "embed" in {c["name"] for c in search_node["children"]}
    assert any(c["attributes"].get("db.system") == "postgresql" for c in search_node["children"])

    def walk(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
        yield node
        for child in node["children"]:
            yield from walk(child)

    assert {node["trace_id"] for node in walk(root)} == {f"{trace_id:032x}"}
    assert len(list(walk(root))) == len(found)


async def test_remember_spans_count_items_and_never_carry_content(
    spans: InMemorySpanExporter, launchers: Launchers
) -> None:
    caller = launchers.caller(user=USER_ID, per_user=True)
    trace_id, _, header = traceparent()
    request = memory_pb2.RememberRequest(items=[memory_pb2.RememberItem(content=c) for c in CONTENTS])
    await caller.memory.Remember(request, metadata=(*caller.metadata, ("traceparent", header)), timeout=20)

    found = await trace_of(spans, trace_id, "/tokensvc.v1.MemoryService/Remember")
    (remember,) = [s for s in found if s.name == "memory.remember"]
    assert remember.attributes is not None
    assert remember.attributes["tokensvc.items"] == 2
    assert remember.attributes["tokensvc.memory.inserted"] == 2
    assert any(s.name == "embed" for s in found)
    assert_nothing_secret(spans.get_finished_spans(), [*CONTENTS, caller.token, USER_ID])


async def test_search_knowledge_has_a_knowledge_search_span(
    spans: InMemorySpanExporter, service: Service, dev: DevPaths
) -> None:
    kb_ref = f"kb-trace-{secrets.token_hex(4)}"
    document = "# Tides\n\nThe heliotrope moorings flood at the spring tide.\n"
    async with open_clients(service, dev) as clients:
        manager = clients.manager()
        await manager.create(kb_ref)
        await manager.upload(kb_ref, "tides.md", document)
        searcher = clients.searcher([kb_ref])
        trace_id, client_span_id, header = traceparent()
        request = knowledge_pb2.SearchKnowledgeRequest(knowledge_base_refs=[kb_ref], query_text="moorings")
        response = await searcher.stub.SearchKnowledge(
            request, metadata=(*searcher.metadata, ("traceparent", header)), timeout=20
        )
        assert response.passages

        found = await trace_of(spans, trace_id, KNOWLEDGE_METHOD)
        by_id = {s.context.span_id: s for s in found}
        (server,) = [s for s in found if s.name == KNOWLEDGE_METHOD]
        assert server.parent is not None
        assert server.parent.span_id == client_span_id
        (search,) = [s for s in found if s.name == "knowledge.search"]
        assert parent_id(search) == server.context.span_id
        assert search.attributes is not None
        assert search.attributes["tokensvc.namespace"] == "default"
        assert search.attributes["tokensvc.agent"] == "dev-agent"
        assert search.attributes["tokensvc.result_count"] == len(response.passages)
        assert any(s.name == "embed" and "knowledge.search" in ancestors(s, by_id) for s in found)
        assert any(is_database(s) and "knowledge.search" in ancestors(s, by_id) for s in found)
        assert_nothing_secret(found, [searcher.token, "heliotrope moorings flood"])
        await manager.delete(kb_ref)


async def test_a_call_without_traceparent_starts_its_own_trace(
    spans: InMemorySpanExporter, launchers: Launchers
) -> None:
    caller = launchers.caller()
    await caller.call("ListMemories", memory_pb2.ListMemoriesRequest())
    for _ in range(100):
        servers = [s for s in spans.get_finished_spans() if s.name.endswith("/ListMemories")]
        if servers:
            break
        await asyncio.sleep(0.05)
    (server,) = servers
    assert server.parent is None


def test_tracing_is_inactive_until_a_provider_is_installed() -> None:
    """Without a provider the edge makes no server span (a fresh interpreter: the provider of
    this test process cannot be removed once the fixtures above installed it)."""
    script = (
        "from opentelemetry.sdk.trace.export import SimpleSpanProcessor\n"
        "from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter\n"
        "from tokensvc.observability import configure_tracing, tracing_active\n"
        "configure_tracing(None)\n"
        "assert not tracing_active(), 'active with nothing to export'\n"
        "configure_tracing(None, extra_processor=SimpleSpanProcessor(InMemorySpanExporter()))\n"
        "assert tracing_active(), 'inactive with a processor installed'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
        env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
    )
    assert result.returncode == 0, result.stderr
