"""Knowledge search on a large base, against the query embedding alone (issue 37, "Speed").

    .venv/bin/python -m bench.knowledge_scale [--chunks 2500 100000] [--rounds 2]

Per size, a knowledge base pinned to the embedded default model holds that many chunks: the
256-word chunks of the document-quality bench's third-party documents (bench/document_questions.toml,
which the questions are about), then distinct chunks of Debian documentation packages
(bench/debian_corpus.py) up to the size, so term statistics are those of a real large corpus: a
base made by repeating a small document set makes every term that many times as common and gives
every chunk that many twins. Their vectors are synthetic clustered 384-d unit vectors
(bench/dataset.py's mixture): embedding 100k chunks would take hours, and what a search costs does
not depend on what its vectors mean. Rows are written by COPY as the database superuser, as the
service writes them (documents, then chunks into the live indexes), then ANALYZE and a restarted
service.

Each base is searched twice: before its BM25 statistics are counted (the text ranker reads every
chunk matching a query word, up to its cap, as a base smaller than the statistics' threshold is
searched), then after (`count_text_statistics`, as a runner counts them once a version lands; the
text ranker reads only the chunks that can reach its top rows). Each time, at concurrency 1, in
`--rounds` alternating rounds: the questions' query embedding by the
service's own embedder in process (the query class: what a search waits for), and SearchKnowledge
over mTLS per mode (VECTOR, TEXT, HYBRID: the default). The number is p50(search) minus
p50(embedding) (TEXT embeds nothing; its p50 is its own): the search's own cost, which the issue
bounds at 5 ms for 100k chunks. Results go to bench/results/knowledge-scale.json.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import statistics
import time
import tomllib
from pathlib import Path
from typing import Any

import numpy as np

from bench import debian_corpus
from bench.dataset import DIM, GLOBAL_CENTERS, clustered
from bench.env import NAMESPACE, BenchEnv, bench_env
from bench.knowledge_quality import MODE_ENUM, capability, create_base, open_clients, search
from bench.load import binary_vectors, copy_connection
from tokensvc.embedders import Demand, WorkClass
from tokensvc.knowledge.chunking import ChunkingStrategy, chunk_document
from tokensvc.knowledge.formats import extract_document
from tokensvc.knowledge.formats.media_types import media_type_for_filename
from tokensvc.storage.postgres.text_statistics import TEXT_STATISTICS
from tokensvc.v1 import common_pb2

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
QUESTIONS = ROOT / "bench" / "document_questions.toml"
STRATEGY = ChunkingStrategy.from_stored("markdown", 256, 0)
MODEL = "multilingual-e5-small"
DOCUMENT_COLUMNS = ["namespace", "kb_ref", "ref", "version", "content_type", "content_sha256", "size_bytes", "chunk_count"]  # fmt: skip
CHUNK_COLUMNS = ["namespace", "kb_ref", "doc_ref", "version", "chunk_index", "text", "start_offset", "end_offset", "dimension", "embedding", "generation"]  # fmt: skip
MODES = ("vector", "text", "hybrid")
CHUNKS_PER_DOCUMENT = 100
COPY_BATCH = 20_000
TARGET_MS = 5.0


def log(message: str) -> None:
    print(f"[knowledge-scale {time.strftime('%H:%M:%S')}] {message}", flush=True)


def corpus(size: int) -> tuple[list[str], list[str], list[str]]:
    """`size` distinct chunk texts, the question set's documents' first, its questions, and each
    question's answer (a passage of its document, whitespace collapsed)."""
    questions = tomllib.loads(QUESTIONS.read_text())["question"]
    texts: list[str] = []
    for name in sorted({q["doc"] for q in questions}):
        path = ROOT / name
        document = extract_document(path.read_bytes(), media_type_for_filename(path.name))
        texts += [chunk.text for chunk in chunk_document(document.text, STRATEGY)]
    known = set(texts)
    texts += [text for text in debian_corpus.chunks(size) if text not in known][: max(0, size - len(texts))]
    return texts, [q["question"] for q in questions], [" ".join(q["answer"].split()) for q in questions]


async def fill(env: BenchEnv, kb_ref: str, texts: list[str], chunks: int, rng: np.random.Generator) -> float:
    """The first `chunks` of `texts` in base `kb_ref`; seconds taken."""
    began = time.perf_counter()
    conn = await copy_connection(env)
    try:
        documents = -(-chunks // CHUNKS_PER_DOCUMENT)
        await conn.copy_records_to_table(
            "documents",
            schema_name="tokensvc",
            columns=DOCUMENT_COLUMNS,
            records=[
                (
                    NAMESPACE,
                    kb_ref,
                    f"copy-{d}",
                    1,
                    "text/plain",
                    hashlib.sha256(b"%d" % d).digest(),
                    0,
                    min(CHUNKS_PER_DOCUMENT, chunks - d * CHUNKS_PER_DOCUMENT),
                )
                for d in range(documents)
            ],
        )
        centers = rng.standard_normal((GLOBAL_CENTERS, DIM)).astype(np.float32)
        centers /= np.linalg.norm(centers, axis=1, keepdims=True)
        for start in range(0, chunks, COPY_BATCH):
            count = min(COPY_BATCH, chunks - start)
            vectors = binary_vectors(clustered(rng, centers, rng.integers(0, GLOBAL_CENTERS, count)))
            records = []
            for offset, vector in enumerate(vectors):
                row = start + offset
                text = texts[row]
                document, index = divmod(row, CHUNKS_PER_DOCUMENT)
                records.append(
                    (NAMESPACE, kb_ref, f"copy-{document}", 1, index, text, 0, len(text), DIM, vector, 0)
                )
            await conn.copy_records_to_table(
                "chunks",
                schema_name="tokensvc",
                columns=CHUNK_COLUMNS,
                records=records,
            )
        await conn.execute("ANALYZE tokensvc.documents; ANALYZE tokensvc.chunks")
    finally:
        await conn.close()
    return time.perf_counter() - began


async def measure(
    env: BenchEnv, refs: dict[int, str], questions: list[str], answers: list[str], rounds: int
) -> dict[str, Any]:
    """Per size and mode, search p50/p95 at concurrency 1, and the query embedding's p50; for TEXT
    (the vectors are synthetic, so only its ranking means anything) the share of questions whose
    answer is in one of the top passages (hit@5)."""
    assert env.service is not None
    assert env.service.embedders is not None
    embedder = env.service.embedders.get(MODEL)
    clients = open_clients(env)
    token = capability(env, list(refs.values()))
    demand = Demand.of(WorkClass.QUERY, "bench")
    embedding: list[float] = []
    latencies: dict[tuple[int, str], list[float]] = {(size, mode): [] for size in refs for mode in MODES}
    text_hits = dict.fromkeys(refs, 0)
    try:
        for question in questions[:5]:  # warm the model, the connections and the caches
            await embedder.embed_query(question, demand)
            for ref in refs.values():
                await search(clients, token, ref, question, getattr(common_pb2, MODE_ENUM["hybrid"]))
        for round_ in range(rounds):
            for question in questions:
                began = time.perf_counter()
                await embedder.embed_query(question, demand)
                embedding.append((time.perf_counter() - began) * 1000)
            for size, ref in refs.items():
                for mode in MODES:
                    enum = getattr(common_pb2, MODE_ENUM[mode])
                    for question, answer in zip(questions, answers, strict=True):
                        passages, ms = await search(clients, token, ref, question, enum)
                        latencies[size, mode].append(ms)
                        if round_ == 0 and mode == "text":
                            found = any(answer in " ".join(p.text.split()) for p in passages)
                            text_hits[size] += found
            log(f"round {round_ + 1}/{rounds} done")
    finally:
        await clients.close()
    embed_p50 = statistics.median(embedding)
    by_size: dict[str, Any] = {}
    for size in refs:
        rows = {}
        for mode in MODES:
            values = sorted(latencies[size, mode])
            p50 = statistics.median(values)
            own = p50 if mode == "text" else p50 - embed_p50
            rows[mode] = {
                "p50_ms": round(p50, 2),
                "p95_ms": round(values[int(0.95 * (len(values) - 1))], 2),
                "search_minus_embedding_ms": round(own, 2),
                "within_target": own <= TARGET_MS,
            }
        rows["text"]["hit_at_5"] = round(text_hits[size] / len(questions), 3)
        by_size[str(size)] = rows
    return {"embedding_p50_ms": round(embed_p50, 2), "by_chunks": by_size}


async def count_statistics(env: BenchEnv, kb_ref: str) -> float:
    """The base's BM25 statistics counted as a runner counts them after a version lands; seconds."""
    began = time.perf_counter()
    conn = await copy_connection(env)
    try:
        policy = TEXT_STATISTICS
        # The function runs as the schema owner, under row-level security: declare the tenant.
        await conn.execute(
            "SELECT set_config('tokensvc.namespace', $1, false), set_config('tokensvc.kbs', '*', false)",
            NAMESPACE,
        )
        counted = await conn.fetchval(
            "SELECT count_text_statistics($1, $2, $3, $4, $5, $6)",
            NAMESPACE,
            kb_ref,
            policy.min_base,
            policy.min_share,
            policy.min_chunks,
            policy.drift,
        )
        if not counted:
            log(f"{kb_ref}: no statistics (bases of fewer than {policy.min_base} chunks keep none)")
    finally:
        await conn.close()
    return time.perf_counter() - began


async def run(sizes: list[int], rounds: int) -> dict[str, Any]:
    texts, questions, answers = corpus(max(sizes))
    log(f"{len(texts)} distinct chunk texts, {len(questions)} questions")
    rng = np.random.default_rng(37)
    async with bench_env() as env:
        await env.start_service()
        clients = open_clients(env)
        refs = {}
        fill_seconds = {}
        try:
            for size in sizes:
                ref = f"scale-{size}"
                await create_base(clients, ref, STRATEGY)
                fill_seconds[str(size)] = round(await fill(env, ref, texts, size, rng), 1)
                refs[size] = ref
                log(f"{ref}: {size} chunks written in {fill_seconds[str(size)]} s")
        finally:
            await clients.close()
        await env.start_service()  # a fresh service: nothing cached from the writes
        log("searching without text statistics (every matching chunk read, up to the cap)")
        without = await measure(env, refs, questions, answers, rounds)
        counting = {str(size): round(await count_statistics(env, ref), 2) for size, ref in refs.items()}
        log(f"text statistics counted in {counting} s")
        with_statistics = await measure(env, refs, questions, answers, rounds)
    return {
        "model": MODEL,
        "distinct_texts": len(texts),
        "corpus": "bench/document_questions.toml documents, then Debian documentation packages (bench/debian_corpus.py)",
        "questions": len(questions),
        "rounds": rounds,
        "fill_seconds": fill_seconds,
        "statistics_seconds": counting,
        "target_ms": TARGET_MS,
        "without_statistics": without,
        "with_statistics": with_statistics,
    }


def table(results: dict[str, Any]) -> str:
    before, after = results["without_statistics"], results["with_statistics"]
    lines = [
        f"query embedding p50 {before['embedding_p50_ms']} ms, then {after['embedding_p50_ms']} ms",
        "| chunks | mode | p50 ms without statistics | with | p50 - embedding ms without | with |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for size, rows in after["by_chunks"].items():
        for mode, row in rows.items():
            old = before["by_chunks"][size][mode]
            lines.append(
                f"| {int(size):,} | {mode} | {old['p50_ms']} | {row['p50_ms']} | "
                f"{old['search_minus_embedding_ms']} | {row['search_minus_embedding_ms']} |"
            )
        lines.append(
            f"| {int(size):,} | text hit@5 | {before['by_chunks'][size]['text']['hit_at_5']} | "
            f"{rows['text']['hit_at_5']} | | |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--chunks", type=int, nargs="+", default=[2_500, 100_000], help="base sizes (default 2500 100000)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternating measurement rounds (default 2)")
    parser.add_argument("--out", type=Path, default=RESULTS / "knowledge-scale.json", help="results file")
    args = parser.parse_args()
    results = asyncio.run(run(args.chunks, args.rounds))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
