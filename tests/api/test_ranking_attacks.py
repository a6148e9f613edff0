"""Attacks on the retrieval engine (TEXT and HYBRID search, pinned text-search configurations)
through the real gRPC server and database.

- query text carrying SQL, tsquery or web-search syntax, backslashes, huge words, thousands of
  words and odd Unicode is plain words: never an error, never a different meaning, nothing
  stored changes;
- a text-search configuration is a name from the allow-list, never SQL;
- an unknown `mode` is INVALID_ARGUMENT naming `mode` on both search RPCs;
- another tenant's rows never appear in TEXT or HYBRID results, and never move a score (BM25
  statistics, min-max scaling, neighbour context);
- no query text reaches a log.

The `hash` embedder (the test default) keeps every vector deterministic.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.api import knowledge_support as ks
from tests.api.memory_support import Caller, Launchers, count_rows, pack
from tests.support import SharedDatabase
from tokensvc.app import Service
from tokensvc.auth.devpki import DevPaths, issue_client_certificate
from tokensvc.observability import configure_tracing
from tokensvc.retrieval import TEXT_CONFIGS
from tokensvc.v1 import common_pb2, memory_pb2

TEXT = common_pb2.SEARCH_MODE_TEXT
HYBRID = common_pb2.SEARCH_MODE_HYBRID
VECTOR = common_pb2.SEARCH_MODE_VECTOR
INVALID = grpc.StatusCode.INVALID_ARGUMENT
MEMORY_QUERY_BYTES = 32 * 1024
KNOWLEDGE_QUERY_BYTES = 8 * 1024

# Two-letter words: 10,000 of them (1,296 distinct) fit a memory query (30,000 bytes).
_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"
_PAIRS = [a + b for a in _ALPHABET for b in _ALPHABET]


def _words(count: int) -> str:
    return " ".join(_PAIRS[i % len(_PAIRS)] for i in range(count))


HOSTILE = {
    "sql-quote": "'; DROP TABLE tokensvc.memories; --",
    "sql-or": "x') OR 1=1 OR ('a'='a",
    "dollar-quote": "$1 $2 $$ $tag$ alpha $tag$ ::regconfig ::tsquery",
    "backslashes": "\\' \\\\ \\x27 E'\\047' alpha\\bravo \\",
    "tsquery-operators": "alpha:* & !bravo | (charlie <-> delta) <2> echo:AB* !!( ) &| :",
    "websearch-syntax": '"alpha bravo -charlie or OR -"- "unclosed',
    "only-operators": "!!!(((&&&|||)))<-><-><->:::***'''\"\"\"---",
    "or-words": "or OR Or oR \uff4f\uff52 \uff2f\uff32 or",
    "long-word": "a" * 30_000,
    "many-long-words": " ".join(["b" * 3000] * 9),
    "ten-thousand-words": _words(10_000),
    "unicode": "caf\u00e9 na\u00efve \u00df \u0130stanbul \ufb03 \U0001d518\U0001d52b\U0001d526\U0001d520\U0001d52c\U0001d521\U0001d522 \u6771\u4eac \u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac \u0440\u0443\u0441\u0441\u043a\u0438\u0439",
    "emoji": "\U0001f389 \U0001f469\u200d\U0001f469\u200d\U0001f467 \U0001f1eb\U0001f1f7 \u2764\ufe0f alpha\U0001f389bravo",
    "right-to-left": "\u200f\u05e9\u05dc\u05d5\u05dd\u200e \u202e\u0639\u0631\u0628\u064a\u202c \u2067x\u2069 \u061c",
    "invisible": "\ufeff\u200b\u2028\u2029\u00ad\u2060 alpha\u200bbravo",
    "combining": "e\u0301 a\u0308\u0308\u0308 Z\u0351\u0362\u0328",
    "control-chars": "alpha\x01\x02\x1b[31m\x7fbravo\r\n\t\x0b\x0c",
}
# The knowledge query limit is 8 KiB: the long ones are cut to fit.
KNOWLEDGE_HOSTILE = {
    name: value if len(value.encode()) <= KNOWLEDGE_QUERY_BYTES else value[: KNOWLEDGE_QUERY_BYTES // 4]
    for name, value in HOSTILE.items()
}
KNOWLEDGE_HOSTILE["ten-thousand-words"] = _words(2700)  # as many as 8 KiB hold


# Every attack runs on both read paths: exact scans (small buckets and corpora) and the HNSW
# index with its exact fallback (every bucket above one row, every corpus above five chunks).
PATHS = {"exact": {}, "hnsw": {"memory_exact_search_threshold": 1}}


@pytest.fixture(params=list(PATHS))
def path(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The settings that select the read path."""
    return PATHS[request.param]


@pytest.fixture
async def routed(path: dict[str, Any], start_service: Any) -> Service:
    service: Service = await start_service(**path)
    return service


@pytest.fixture
async def launchers(routed: Service, dev: DevPaths, tmp_path: Path) -> AsyncIterator[Launchers]:
    pool = Launchers(routed, dev, tmp_path / "launchers")
    yield pool
    await pool.aclose()


@pytest.fixture
async def clients(routed: Service, dev: DevPaths) -> AsyncIterator[ks.Clients]:
    async with ks.open_clients(routed, dev) as opened:
        yield opened


def _request(query: str | bytes, mode: int, **fields: Any) -> memory_pb2.SearchMemoriesRequest:
    request = memory_pb2.SearchMemoriesRequest(mode=mode, **fields)  # type: ignore[arg-type]
    if isinstance(query, bytes):
        request.query_vector = query
    else:
        request.query_text = query
    return request


def _outcome(results: list[memory_pb2.MemorySearchResult]) -> tuple[list[Any], list[float]]:
    """What a caller sees, up to exact ties (ranks among equal scores are broken by random ids)."""
    scored = sorted((r.memory.content, round(r.score, 5), r.text_rank > 0) for r in results)
    return scored, [round(r.score, 5) for r in results]


# --- query text is plain words ----------------------------------------------------------------


OWNER_MEMORIES = (
    "alpha bravo charlie",
    "delta echo foxtrot",
    "caf\u00e9 na\u00efve \u0130stanbul \u6771\u4eac",
    "\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd \u0639\u0631\u0628\u064a",
    "or either neither",
)


@pytest.mark.parametrize("query", list(HOSTILE.values()), ids=list(HOSTILE))
async def test_hostile_memory_query_text_is_plain_words_never_an_error_or_a_leak(
    launchers: Launchers, database: SharedDatabase, query: str
) -> None:
    owner, intruder = launchers.caller(), launchers.caller()
    own_ids = set(await owner.remember(*OWNER_MEMORIES))
    # The intruder stores the query itself: the best possible match, in another bucket.
    await intruder.remember(query, "alpha bravo charlie")
    buckets = [await owner.bucket(), await intruder.bucket()]
    before = [await count_rows(database, bucket) for bucket in buckets]
    for mode in (TEXT, HYBRID):
        results = await owner.search(query, mode=mode, top_k=100)
        assert {r.memory.id for r in results} <= own_ids
        if mode == TEXT:
            assert all(r.text_rank >= 1 and r.vector_rank == 0 for r in results)
        else:
            assert len(results) == len(own_ids)  # the vector ranker answers every query
    assert [await count_rows(database, bucket) for bucket in buckets] == before
    # The intruder's own search still works, and finds only its own rows.
    assert own_ids.isdisjoint(r.memory.id for r in await intruder.search(query, mode=TEXT, top_k=100))


@pytest.mark.parametrize("query", list(KNOWLEDGE_HOSTILE.values()), ids=list(KNOWLEDGE_HOSTILE))
async def test_hostile_knowledge_query_text_is_plain_words_never_an_error_or_a_leak(
    clients: ks.Clients, database: SharedDatabase, query: str
) -> None:
    manager = clients.manager()
    mine, other = ks.new_ref(), ks.new_ref()
    for ref in (mine, other):
        await manager.create(ref, ks.FIXED, 16)
    await manager.upload(mine, "own.txt", "\n\n".join(OWNER_MEMORIES), content_type="text/plain")
    await manager.upload(other, "query.txt", query, content_type="text/plain")
    before = [await ks.row_counts(database, ref) for ref in (mine, other)]
    searcher = clients.searcher([mine])
    for mode in (TEXT, HYBRID, VECTOR):
        passages = await searcher.search(query, [mine], mode=mode, top_k=100)
        assert {p.knowledge_base_ref for p in passages} <= {mine}
        if mode == TEXT:
            assert all(p.text_rank >= 1 and p.vector_rank == 0 for p in passages)
        else:
            assert passages
    assert [await ks.row_counts(database, ref) for ref in (mine, other)] == before


async def test_tsquery_and_websearch_operators_in_a_text_query_are_only_words(launchers: Launchers) -> None:
    caller = launchers.caller()
    await caller.remember("foo", "foobar", "apple pie", "banana split", "split banana")

    async def text(query: str) -> set[str]:
        return {r.memory.content for r in await caller.search(query, mode=TEXT, top_k=100)}

    assert await text("foo:*") == {"foo"}  # no prefix matching
    assert await text("foo:A*") == {"foo"}
    assert await text("-apple") == {"apple pie"}  # no exclusion
    assert await text("!apple") == {"apple pie"}  # no negation
    assert await text("!!apple & !pie") == {"apple pie"}
    # No phrases and no AND: any word matches, in any order.
    assert await text('"banana split"') == {"banana split", "split banana"}
    assert await text("banana <-> split") == {"banana split", "split banana"}
    assert await text("banana <1> split") == {"banana split", "split banana"}
    assert await text("apple & banana") == {"apple pie", "banana split", "split banana"}
    assert await text("(apple | zzz) & !banana") == {"apple pie", "banana split", "split banana"}
    assert await text("'apple'") == {"apple pie"}
    assert await text("apple\\") == {"apple pie"}


# 70+ distinct English stop words: a long, chatty question (or padding) before its one real term.
STOP_WORDS = (
    "i me my myself we our ours ourselves you your yours yourself yourselves he him his himself she "
    "her hers herself it its itself they them their theirs themselves what which who whom this that "
    "these those am is are was were be been being have has had having do does did doing a an the "
    "and but if because as until while of at by for with about against between into through during "
    "before after above below"
)


async def _text_contents(caller: Caller, query: str) -> set[str]:
    return {r.memory.content for r in await caller.search(query, mode=TEXT, top_k=100)}


async def test_stop_word_padding_does_not_hide_a_questions_real_term(launchers: Launchers) -> None:
    caller = launchers.caller()
    await caller.remember("zebra crossing", "alpha zebra", "nothing else")
    assert len(set(STOP_WORDS.split())) >= 70
    # Stop words carry no weight, so they must not push the real term out of the query.
    assert await _text_contents(caller, f"{STOP_WORDS} zebra") == {"zebra crossing", "alpha zebra"}


async def test_a_term_that_scores_also_matches(launchers: Launchers) -> None:
    caller = launchers.caller()
    await caller.remember("zebra crossing", "alpha zebra", "nothing else")
    filler = " ".join(f"w{i}" for i in range(70))
    query = f"alpha {filler} zebra"
    found = {r.memory.content: r.score for r in await caller.search(query, mode=TEXT, top_k=100)}
    # TEXT scores are on the query's own scale (BM25 over what the query could score at best), so
    # compare with the same query less its last term.
    without = f"alpha {filler}"
    alone = {r.memory.content: r.score for r in await caller.search(without, mode=TEXT, top_k=100)}
    assert found["alpha zebra"] > alone["alpha zebra"]  # `zebra` counted for this row...
    assert set(found) == {"zebra crossing", "alpha zebra"}  # ...so the row with only `zebra` matches


async def test_a_query_at_the_size_limit_is_served_and_one_byte_more_is_refused(launchers: Launchers) -> None:
    caller = launchers.caller()
    await caller.remember("zz marks the spot")
    at_limit = ("zz " * MEMORY_QUERY_BYTES)[:MEMORY_QUERY_BYTES]
    assert len(at_limit.encode()) == MEMORY_QUERY_BYTES
    for mode in (TEXT, HYBRID):
        assert [r.memory.content for r in await caller.search(at_limit, mode=mode)] == ["zz marks the spot"]
        refused = await caller.fail("SearchMemories", _request(at_limit + "z", mode))
        assert refused.code in (INVALID, grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert refused.field_violations == ["query_text"]


async def test_a_knowledge_query_of_ten_thousand_words_is_refused_naming_query_text(
    clients: ks.Clients,
) -> None:
    ref = ks.new_ref()
    await clients.manager().create(ref, ks.FIXED, 16)
    for mode in (TEXT, HYBRID):
        refused = await ks.failure(clients.searcher([ref]).search(_words(10_000), [ref], mode=mode))
        assert refused.code == INVALID
        assert refused.field_violations == ["query_text"]


# --- text_search_config is a name, never SQL --------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        "english'; DROP TABLE tokensvc.chunks; --",
        "english'::regconfig, 'simple",
        "english::regconfig",
        "pg_catalog.simple",
        "public.english",
        "tokensvc.english",
        '"english"',
        "ENGLISH",
        "English",
        " english",
        "english ",
        "english\n",
        "simple\t",
        "\u0435nglish",  # a Cyrillic e
        "english\u200b",
        "1",
        "3748",  # a regconfig OID
        "-",
        "*",
        "estonian",  # a PostgreSQL configuration, not on the allow-list
        "x" * 100_000,
    ],
)
async def test_an_injected_text_search_config_is_invalid_argument_and_creates_nothing(
    clients: ks.Clients, database: SharedDatabase, config: str
) -> None:
    ref = ks.new_ref()
    refused = await ks.failure(clients.manager().create(ref, ks.FIXED, 32, text_search_config=config))
    assert refused.code == INVALID
    assert refused.field_violations == ["text_search_config"]
    assert await ks.row_counts(database, ref) == (0, 0, 0)


async def test_every_allowed_text_search_config_creates_indexes_and_searches(clients: ks.Clients) -> None:
    manager = clients.manager()
    for config in sorted(TEXT_CONFIGS):
        ref = ks.new_ref()
        created = await manager.create(ref, ks.FIXED, 32, text_search_config=config)
        assert created.knowledge_base.text_search_config == config
        await manager.upload(ref, "doc.txt", "quetzalcoatl 12345 zyxwv", content_type="text/plain")
        assert (await manager.get(ref)).text_search_config == config
        searcher = clients.searcher([ref])
        for mode in (TEXT, HYBRID):
            found = await searcher.search("quetzalcoatl 12345 zyxwv", [ref], mode=mode)
            assert [p.document_ref for p in found] == ["doc.txt"], (config, mode)


# --- unknown modes ----------------------------------------------------------------------------

UNKNOWN_MODES = [4, 99, -1, 2**31 - 1, -(2**31)]


@pytest.mark.parametrize("mode", UNKNOWN_MODES)
async def test_an_unknown_memory_search_mode_is_invalid_argument_naming_mode(
    launchers: Launchers, mode: int
) -> None:
    caller = launchers.caller()
    await caller.remember("something to find")
    for query in ("something", pack([1.0] * 384)):
        refused = await caller.fail("SearchMemories", _request(query, mode))
        assert refused.code == INVALID
        assert refused.field_violations == ["mode"]


@pytest.mark.parametrize("mode", UNKNOWN_MODES)
async def test_an_unknown_knowledge_search_mode_is_invalid_argument_naming_mode(
    clients: ks.Clients, mode: int
) -> None:
    ref = ks.new_ref()
    await clients.manager().create(ref, ks.FIXED, 16)
    await clients.manager().upload(ref, "a.txt", "something to find", content_type="text/plain")
    refused = await ks.failure(clients.searcher([ref]).search("something", [ref], mode=mode))
    assert refused.code == INVALID
    assert refused.field_violations == ["mode"]


@pytest.mark.parametrize("mode", [TEXT, HYBRID])
async def test_a_text_mode_with_a_query_vector_is_invalid_argument_naming_mode(
    launchers: Launchers, mode: int
) -> None:
    caller = launchers.caller()
    await caller.remember("something to find")
    refused = await caller.fail("SearchMemories", _request(pack([1.0] * 384), mode))
    assert refused.code == INVALID
    assert refused.field_violations == ["mode"]


# --- tenant isolation -------------------------------------------------------------------------

QUERY = "saffron cardamom recipe"
OWN = (
    "my saffron cardamom recipe for the holidays",
    "saffron rice",
    "cardamom tea with milk and honey",
    "a weather note about rain",
    "saffron is pricey this year indeed",
    "grandma wrote the recipe down somewhere",
    "unrelated shopping list",
)
# What the intruder stores: exact and near matches that would move any leaked statistic.
INTRUDING = (QUERY, *(f"{QUERY} variant {i}" for i in range(12)), "saffron saffron saffron")


def _relationships(launchers: Launchers) -> dict[str, Callable[[], tuple[Caller, Caller]]]:
    agent = launchers.new_agent()
    return {
        "two-agents": lambda: (launchers.caller(agent), launchers.caller()),
        "two-users-of-one-agent": lambda: (
            launchers.caller(agent, user="user-x", per_user=True),
            launchers.caller(agent, user="user-y", per_user=True),
        ),
        "user-vs-agent-wide": lambda: (
            launchers.caller(agent, user="user-x", per_user=True),
            launchers.caller(agent, user="user-x"),
        ),
        "agent-wide-vs-user": lambda: (
            launchers.caller(agent, user="user-x"),
            launchers.caller(agent, user="user-x", per_user=True),
        ),
    }


@pytest.mark.parametrize(
    "relationship", ["two-agents", "two-users-of-one-agent", "user-vs-agent-wide", "agent-wide-vs-user"]
)
async def test_another_buckets_exact_matches_neither_appear_nor_move_scores(
    launchers: Launchers, start_service: Any, path: dict[str, Any], relationship: str
) -> None:
    owner, intruder = _relationships(launchers)[relationship]()
    # The owner's memories in the same order, in a bucket with no neighbour, searched on a server
    # of its own: any state the intruder's searches leave in the owner's server would show.
    control = launchers.caller(service=await start_service(**path))
    assert len({await owner.bucket(), await intruder.bucket(), await control.bucket()}) == 3
    intruder_ids: set[str] = set()
    for index, content in enumerate(OWN):
        await owner.remember(content)
        await control.remember(content)
        # Interleaved in time: were neighbours not per bucket, these would be the owner's.
        intruder_ids.update(await intruder.remember(INTRUDING[index % len(INTRUDING)]))
    intruder_ids.update(await intruder.remember(*INTRUDING))
    cases = [(mode, query) for mode in (TEXT, HYBRID) for query in (QUERY, OWN[0], "saffron")]
    for mode, query in cases:  # the intruder first: whatever it leaves behind, the owner meets
        theirs = await intruder.search(query, mode=mode, top_k=100)
        assert theirs
        assert {r.memory.id for r in theirs} <= intruder_ids
    for mode, query in cases:
        mine = await owner.search(query, mode=mode, top_k=100)
        assert intruder_ids.isdisjoint(r.memory.id for r in mine)
        expected = await control.search(query, mode=mode, top_k=100)
        assert _outcome(mine) == _outcome(expected), (mode, query)


async def test_another_namespaces_or_unsearched_corpus_neither_appears_nor_moves_scores(
    clients: ks.Clients, start_service: Any, path: dict[str, Any], dev: DevPaths, tmp_path: Path
) -> None:
    manager, other_manager = clients.manager(), clients.manager(namespace="other")
    ref, sibling = ks.new_ref(), ks.new_ref()
    await manager.create(ref, ks.RECURSIVE, 16)
    await manager.upload(ref, "recipes.md", "\n\n".join(OWN), content_type="text/plain")

    async def outcome(who: ks.Searcher, mode: int, query: str) -> list[Any]:
        passages = await who.search(query, [ref], mode=mode, top_k=100)
        assert {(p.knowledge_base_ref, p.document_ref) for p in passages} <= {(ref, "recipes.md")}
        scored = sorted((p.citation, round(p.score, 5)) for p in passages)
        return [scored, [(round(p.score, 5), p.vector_rank, p.text_rank) for p in passages]]

    cases = [(mode, query) for mode in (TEXT, HYBRID) for query in (QUERY, OWN[0], "saffron")]
    baseline = {case: await outcome(clients.searcher([ref]), *case) for case in cases}
    intruding = "\n\n".join(INTRUDING)
    # The same ref and document in another namespace; a sibling corpus granted but not searched.
    await other_manager.create(ref, ks.RECURSIVE, 16)
    await other_manager.upload(ref, "recipes.md", intruding, content_type="text/plain")
    await manager.create(sibling, ks.RECURSIVE, 16)
    await manager.upload(sibling, "recipes.md", intruding, content_type="text/plain")
    certificate = issue_client_certificate(
        dev, f"spiffe://dev.local/ns/other/sa/{ks.AGENT}", tmp_path, "other"
    )
    # A fresh server, where the other namespace searches first.
    async with ks.open_clients(await start_service(**path), dev) as fresh:
        other = fresh.searcher([ref], namespace="other", certificate=certificate)
        for mode, query in cases:
            theirs = await other.search(query, [ref], mode=mode, top_k=100)
            assert theirs
            assert all(p.text in intruding for p in theirs)
        for case in cases:
            assert await outcome(fresh.searcher([ref]), *case) == baseline[case], case
            assert await outcome(fresh.searcher([ref, sibling]), *case) == baseline[case], case
            assert await outcome(clients.searcher([ref, sibling]), *case) == baseline[case], case


# --- nothing logs query text ------------------------------------------------------------------


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    spans = InMemorySpanExporter()
    configure_tracing(None, extra_processor=SimpleSpanProcessor(spans))
    yield spans
    spans.shutdown()  # the provider keeps the processor; a stopped exporter drops what it gets


def _span_texts(spans: Sequence[ReadableSpan]) -> str:
    texts: list[str] = []
    for span in spans:
        texts += [span.name, span.status.description or ""]
        texts += [f"{key}={json.dumps(value, default=str)}" for key, value in (span.attributes or {}).items()]
        for event in span.events:
            texts += [event.name, json.dumps(dict(event.attributes or {}), default=str)]
    return "\n".join(texts)


async def test_query_text_never_reaches_a_log_or_a_trace(
    exporter: InMemorySpanExporter,
    launchers: Launchers,
    clients: ks.Clients,
    database: SharedDatabase,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    exporter.clear()
    marker = f"quokka{uuid.uuid4().hex}"
    query = f"{marker} '; DROP TABLE x; -- {marker}:* & !{marker}"
    caller = launchers.caller()
    await caller.remember(f"a memory about {marker}")
    for mode in (TEXT, HYBRID, VECTOR):
        assert await caller.search(query, mode=mode)
    for request in (
        _request(query, 99),
        _request(query + "\x00", TEXT),
        _request(query + " " + "y" * MEMORY_QUERY_BYTES, HYBRID),
    ):
        await caller.fail("SearchMemories", request)
    ref = ks.new_ref()
    manager = clients.manager()
    await manager.create(ref, ks.FIXED, 32)
    await manager.upload(ref, "a.txt", f"a passage about {marker}", content_type="text/plain")
    searcher = clients.searcher([ref])
    for mode in (TEXT, HYBRID, VECTOR):
        assert await searcher.search(query, [ref], mode=mode)
    refused: list[tuple[int, str]] = [
        (99, query),
        (TEXT, query + "\x00"),
        (HYBRID, query + "y" * KNOWLEDGE_QUERY_BYTES),
    ]
    for bad_mode, text in refused:
        await ks.failure(searcher.search(text, [ref], mode=bad_mode))
    # A refused text_search_config is echoed to the caller (and so in the span's status), not logged.
    config = f"wombat{uuid.uuid4().hex}"
    await ks.failure(manager.create(ks.new_ref(), ks.FIXED, 32, text_search_config=config))
    logs = "\n".join(f"{record.getMessage()} {record.__dict__}" for record in caplog.records)
    assert "SearchMemories" in logs  # the RPC log was captured
    assert marker not in logs
    assert config not in logs
    assert marker not in database.server.paths.log.read_text(errors="replace")
    traced = _span_texts(exporter.get_finished_spans())
    assert "memory.search" in traced
    assert "knowledge.search" in traced
    assert "db.statement" in traced  # the SQL is traced, its parameters are not
    assert marker not in traced
