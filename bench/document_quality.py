"""Knowledge-base retrieval quality on third-party documents of every format, next to a LangChain build.

    .venv/bin/python -m bench.document_quality [--quick] [--study/--no-study | --study-only] [--questions PATH]

The documents are the ones the question file names (bench/document_questions.toml: PDF, DOCX,
PPTX, XLSX, CSV, JSON Lines); each question quotes its answer verbatim from the document's
extracted text (whitespace collapsed; located once, as bench/questions.py does) and, for paged or
tabular formats, says independently where it is: a PDF's page, a PPTX's slide, an XLSX's sheet and
row, a CSV's or JSON Lines' row. Extraction is `tokensvc.knowledge.formats.extract_document` by
the file's type, here, which is what the service stores. Measured:

1. The service: one knowledge base with the server's defaults (markdown chunking, 256 words, the
   default embedder); every document uploaded with its content type, waiting until READY; every
   question asked through SearchKnowledge (top_k = 5) over mTLS per mode (vector, text, hybrid).
   Every returned passage's text is checked against the local text's slice at its offsets
   (`text_mismatches`), and the server's chunk count against the local chunker's.
2. The peer: LangChain's loaders' units split by RecursiveCharacterTextSplitter (1000/200 chars),
   the same documents, extraction and e5 vectors, exact cosine top 5 (bench/document_pipelines.py).
3. The chunking study (`--no-study` skips it): the service's markdown chunker at 128, 192 and 256
   words, each embedding the chunk's text or its heading path and text, exact cosine top 5; per
   variant the chunks' mean e5 tokens and the share past the model's 512-token window.

A returned passage *hits* when it is from the question's document and its [start, end) holds the
answer's first character. Per system, overall and per format: hit@1, hit@5, mrr@5 (1/rank of the
first hit); for the service and the peer also `cited@1`, the share of questions (with a location)
whose first passage's location covers the truth (page or slide within first..last; same sheet and
row within first..last), and `cited_when_hit`, the share of hitting passages whose location covers
it (are the citations right). `truth_disagreements` lists questions whose truth the extraction's
own spans do not give for the answer's start (a wrong question, or a locator bug).

`--quick` skips documents over 100,000 extracted characters and asks at most two questions per
document. `run_document_quality(env)` measures against a running `bench.env` service (as
bench/quality.py does); alone, the command starts its own world and writes
bench/results/document-quality.json (rewritten after each part, so an interrupted run keeps what
it measured), then prints the tables.

Abstention (bench/abstention.py): every question is asked again with its source filtered out (its
document and those made from the same text, `source_of`), where the base holds no answer; per mode
the AUROC of the best score with against without, and what `min_score` 0.8 keeps and drops.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import abstention
from bench.abstention import RECOMMENDED_MIN_SCORE
from bench.document_pipelines import (
    E5_WINDOW_TOKENS,
    Retrieved,
    TokenCounter,
    VectorCache,
    format_of,
    log,
    peer_pieces,
    search_pieces,
    study_pieces,
    token_stats,
)
from bench.env import BenchEnv, bench_env
from bench.knowledge_quality import (
    MODES,
    TOP_K,
    capability,
    create_base,
    doc_ref,
    metrics,
    open_clients,
    search,
    search_modes,
    upload,
)
from bench.questions import Question, Span, covers, load_extracted, load_questions, locate_all
from tokensvc.knowledge.chunking import DEFAULT_CHUNK_SIZE, ChunkingStrategy, chunk_document
from tokensvc.knowledge.formats import ExtractedDocument, SpanIndex
from tokensvc.v1 import common_pb2

__all__ = ["QUESTIONS", "run_document_quality"]

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = ROOT / "bench" / "document_questions.toml"
OUTPUT = ROOT / "bench" / "results" / "document-quality.json"
FORMATS = ("pdf", "docx", "pptx", "xlsx", "csv", "jsonl")
STUDY_SIZES = (256, 192, 128)  # the default first: it checks the study against the service
QUICK_MAX_CHARS = 100_000
QUICK_PER_DOCUMENT = 2
CONCURRENCY = 8
Saver = Callable[[], None]


# --- questions, documents and truths -----------------------------------------------------------


@dataclass(frozen=True)
class Corpus:
    """The questions, their documents' extraction and where each answer starts."""

    questions: list[Question]
    documents: dict[str, ExtractedDocument]
    answers: dict[int, Span]
    skipped_documents: list[str]

    def format(self, q: Question) -> str:
        return format_of(self.documents[q.doc])


def load_corpus(path: Path, quick: bool) -> Corpus:
    questions = load_questions(path)
    documents = load_extracted(sorted({q.doc for q in questions}))
    skipped = []
    if quick:
        skipped = [name for name, d in documents.items() if len(d.text) > QUICK_MAX_CHARS]
        asked: dict[str, int] = {}
        kept = []
        for q in questions:
            if q.doc not in skipped and asked.get(q.doc, 0) < QUICK_PER_DOCUMENT:
                asked[q.doc] = asked.get(q.doc, 0) + 1
                kept.append(q)
        questions = kept
        documents = {name: d for name, d in documents.items() if name not in skipped}
    answers = locate_all(questions, {name: d.text for name, d in documents.items()})
    return Corpus(questions, documents, answers, skipped)


def truth_of(q: Question) -> dict[str, Any]:
    fields = {"page": q.page, "slide": q.slide, "sheet": q.sheet, "row": q.row}
    return {name: value for name, value in fields.items() if value}


def truth_disagreements(corpus: Corpus) -> list[dict[str, Any]]:
    """Questions whose truth is not where the extraction's own spans put the answer's start."""
    found = []
    for q in corpus.questions:
        start = corpus.answers[q.number].start
        location = SpanIndex(corpus.documents[q.doc].spans).locate(start, start + 1)
        if covers(location, q) is False:
            found.append(
                {"question": q.number, "doc": q.doc, "truth": truth_of(q), "extracted": str(location)}
            )
    return found


# --- scoring -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """One question's returned list, judged: the first hit's rank (None: no hit), whether the
    first passage's location covers the truth, and the same for every hitting passage."""

    rank: int | None
    cited_first: bool | None
    cited_hits: tuple[bool, ...]
    miscited: tuple[str, ...]  # the locations of hitting passages that do not cover the truth


def judge(q: Question, answer: Span, returned: Sequence[Retrieved]) -> Outcome:
    hit_ranks = [
        rank for rank, r in enumerate(returned, start=1) if r.doc == q.doc and r.start <= answer.start < r.end
    ]
    hits = [returned[rank - 1] for rank in hit_ranks]
    rank = hit_ranks[0] if hit_ranks else None
    cited_first = None
    if truth_of(q):  # a first passage from another document cites nothing of this one
        cited_first = bool(returned and returned[0].doc == q.doc and covers(returned[0].location, q))
    cited_hits = tuple(bool(covers(r.location, q)) for r in hits) if truth_of(q) else ()
    miscited = tuple(_where(r.location) for r, cited in zip(hits, cited_hits, strict=False) if not cited)
    return Outcome(rank, cited_first, cited_hits, miscited)


def _where(location: Any) -> str:
    fields = ("first_page", "last_page", "first_slide", "last_slide", "sheet", "first_row", "last_row")
    return ", ".join(f"{name}={getattr(location, name)}" for name in fields if getattr(location, name))


def _share(values: Sequence[bool]) -> float | None:
    return round(sum(values) / len(values), 3) if values else None


def summary(outcomes: Sequence[Outcome], citations: bool) -> dict[str, Any]:
    summed = metrics([o.rank for o in outcomes])
    if citations:
        summed["cited@1"] = _share([o.cited_first for o in outcomes if o.cited_first is not None])
        summed["cited_when_hit"] = _share([c for o in outcomes for c in o.cited_hits])
    return summed


def scored(corpus: Corpus, outcomes: dict[int, Outcome], citations: bool = True) -> dict[str, Any]:
    """Overall and per format, the formats in FORMATS order."""
    by_format: dict[str, list[Outcome]] = {}
    for q in corpus.questions:
        by_format.setdefault(corpus.format(q), []).append(outcomes[q.number])
    return {
        **summary(list(outcomes.values()), citations),
        "by_format": {f: summary(by_format[f], citations) for f in _in_order(by_format)},
        "missed@5": [number for number, o in outcomes.items() if o.rank is None],
        "ranks": {number: o.rank for number, o in outcomes.items()},
        **({"miscited": _miscited(corpus, outcomes)} if citations else {}),
    }


def _miscited(corpus: Corpus, outcomes: dict[int, Outcome]) -> list[dict[str, Any]]:
    """Hitting passages whose location does not cover the truth: a wrong citation."""
    return [
        {"question": q.number, "doc": q.doc, "truth": truth_of(q), "cited": list(outcomes[q.number].miscited)}
        for q in corpus.questions
        if outcomes[q.number].miscited
    ]


def _in_order(formats: Any) -> list[str]:
    """Formats in FORMATS order, any other after them by name."""
    return sorted(formats, key=lambda f: (FORMATS.index(f) if f in FORMATS else len(FORMATS), f))


def judged(corpus: Corpus, returned: Sequence[Sequence[Retrieved]]) -> dict[int, Outcome]:
    return {
        q.number: judge(q, corpus.answers[q.number], r)
        for q, r in zip(corpus.questions, returned, strict=True)
    }


# --- the service -------------------------------------------------------------------------------


async def measure_service(env: BenchEnv, corpus: Corpus) -> tuple[dict[str, Any], str]:
    """Upload every document into one default knowledge base and ask every question per mode;
    the results and the knowledge base's embedder."""
    strategy = ChunkingStrategy.from_request("markdown")
    clients = open_clients(env)
    try:
        ref = f"docq-{uuid.uuid4().hex[:8]}"
        created = await create_base(clients, ref, strategy)
        names_by_ref = {doc_ref(name): name for name in corpus.documents}
        chunk_mismatches, chunks = [], 0
        began = time.perf_counter()
        for name, document in corpus.documents.items():
            log(f"uploading {name} ({len(document.text):,} characters)")
            stored = await upload(
                clients,
                ref,
                name,
                (ROOT / name).read_bytes(),
                document.media_type,
                {"source": source_of(name)},
            )
            local = len(chunk_document(document.text, strategy))
            chunks += stored
            if stored != local:
                chunk_mismatches.append({"doc": name, "server": stored, "local": local})
        upload_s = time.perf_counter() - began
        token = capability(env, [ref])
        mode_values, skipped = search_modes(MODES)
        text_mismatches: dict[str, dict[str, Any]] = {}
        gate = asyncio.Semaphore(CONCURRENCY)

        async def ask(q: Question, mode: int) -> tuple[list[Retrieved], float, float]:
            async with gate:
                passages, latency = await search(clients, token, ref, q.question, mode)
            best = passages[0].score if passages else 0.0
            returned = []
            for p in passages:
                name = names_by_ref[p.document_ref]
                local = corpus.documents[name].text[p.start_offset : p.end_offset]
                if p.text != local and p.citation not in text_mismatches:
                    text_mismatches[p.citation] = {
                        "start": p.start_offset, "end": p.end_offset, "server": p.text[:120], "local": local[:120]
                    }  # fmt: skip
                returned.append(Retrieved(name, p.start_offset, p.end_offset, p.location))
            return returned, latency, best

        async def ask_elsewhere(q: Question, mode: int) -> float:
            """The best score with the question's own source filtered out: the base then holds no
            answer (abstention, as bench/locomo.py measures it for memories)."""
            async with gate:
                passages, _ = await search(clients, token, ref, q.question, mode, not_from(source_of(q.doc)))
            return passages[0].score if passages else 0.0

        modes = {}
        for mode, value in mode_values.items():
            log(f"service: {len(corpus.questions)} questions, {mode} mode")
            answered = await asyncio.gather(*(ask(q, value) for q in corpus.questions))
            log(f"service: {len(corpus.questions)} questions, {mode} mode, without their sources")
            absent = await asyncio.gather(*(ask_elsewhere(q, value) for q in corpus.questions))
            modes[mode] = {
                **scored(corpus, judged(corpus, [returned for returned, _, _ in answered])),
                "latency_ms_p50": round(statistics.median(latency for _, latency, _ in answered), 1),
                "abstention": abstention.summary(
                    [best for _, _, best in answered], list(absent), RECOMMENDED_MIN_SCORE.get(mode)
                ),
            }
    finally:
        await clients.close()
    return {
        "knowledge_base": ref,
        "embedder": created.embedder,
        "chunks": chunks,
        "upload_s": round(upload_s, 1),
        "chunk_count_mismatches": chunk_mismatches,
        "text_mismatches": list(text_mismatches.values()),
        "skipped_modes": skipped,
        "modes": modes,
    }, created.embedder


def source_of(document: str) -> str:
    """What a document was made from: the slides and the DOCX of one manual share their text, and
    the ISO code lists share their codes, so a question's answer may be in its document's siblings."""
    stem = Path(document).stem.removesuffix("-slides")
    return "iso-codes" if stem.startswith("iso-") else stem


def not_from(source: str) -> common_pb2.Filter:
    """Every document but those made from `source` (uploaded with metadata `source`)."""
    own = common_pb2.FieldFilter(
        key="source",
        operator=common_pb2.FILTER_OPERATOR_EQ,
        value=common_pb2.MetadataValue(string_value=source),
    )
    return common_pb2.Filter(not_filter=common_pb2.Filter(field=own))


# --- the offline pipelines ---------------------------------------------------------------------


async def measure_peer(corpus: Corpus, cache: VectorCache) -> dict[str, Any]:
    began = time.perf_counter()
    pieces = peer_pieces(corpus.documents)
    log(f"peer: {len(pieces)} LangChain chunks")
    returned = await search_pieces(pieces, cache, [q.question for q in corpus.questions], TOP_K)
    return {
        "pipeline": "LangChain loaders' units, RecursiveCharacterTextSplitter(1000, 200), exact cosine",
        "chunks": len(pieces),
        **scored(corpus, judged(corpus, returned)),
        "seconds": round(time.perf_counter() - began, 1),
    }


async def measure_study(corpus: Corpus, cache: VectorCache, study: dict[str, Any], saved: Saver) -> None:
    """Every variant into `study`, saved after each."""
    counter = TokenCounter() if cache.counts_e5_tokens else None
    variants: dict[str, Any] = {}
    study.update(window_tokens=E5_WINDOW_TOKENS, variants=variants)
    for size in STUDY_SIZES:
        for heading_prefix in (False, True):
            name = f"{size}{'+headings' if heading_prefix else ''}"
            began = time.perf_counter()
            pieces = study_pieces(corpus.documents, size, heading_prefix)
            log(f"study {name}: {len(pieces)} chunks")
            returned = await search_pieces(pieces, cache, [q.question for q in corpus.questions], TOP_K)
            variants[name] = {
                "chunk_size": size,
                "heading_prefix": heading_prefix,
                **token_stats(pieces, counter, {name: format_of(d) for name, d in corpus.documents.items()}),
                **scored(corpus, judged(corpus, returned), citations=False),
                "seconds": round(time.perf_counter() - began, 1),
            }
            saved()


def agreement(ours: dict[str, Any], theirs: dict[str, Any]) -> float:
    """The share of questions with the same first-hit rank in two results (the study's 256-word
    variant is the service's own chunking: it should agree with the service's vector mode)."""
    same = [rank == theirs["ranks"].get(number) for number, rank in ours["ranks"].items()]
    return round(sum(same) / len(same), 3) if same else 1.0


# --- the whole run -----------------------------------------------------------------------------


async def run_document_quality(
    env: BenchEnv,
    *,
    questions_file: Path = QUESTIONS,
    quick: bool = False,
    study: bool = True,
    study_only: bool = False,
    checkpoint: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Measure against `env`'s running service (see the module docstring); `checkpoint` gets the
    results so far after each part (the service, the peer, each study variant)."""
    began = time.perf_counter()
    corpus = load_corpus(questions_file, quick)
    results: dict[str, Any] = {
        "questions_file": str(questions_file),
        "questions": len(corpus.questions),
        "questions_by_format": {
            f: sum(corpus.format(q) == f for q in corpus.questions)
            for f in _in_order({corpus.format(q) for q in corpus.questions})
        },
        "documents": {
            name: {"format": format_of(d), "characters": len(d.text), "spans": len(d.spans)}
            for name, d in corpus.documents.items()
        },
        "skipped_documents": corpus.skipped_documents,
        "top_k": TOP_K,
        "quick": quick,
        "truth_disagreements": truth_disagreements(corpus),
    }

    def saved() -> None:
        results["seconds"] = round(time.perf_counter() - began, 1)
        if checkpoint is not None:
            checkpoint(results)

    assert env.service is not None
    assert env.service.embedders is not None
    if study_only:
        cache = VectorCache(env.service.embedders.get(env.service.settings.memory_embedder))
    else:
        results["service"], embedder_name = await measure_service(env, corpus)
        saved()
        cache = VectorCache(env.service.embedders.get(embedder_name))
        results["peer"] = await measure_peer(corpus, cache)
        saved()
    if study or study_only:
        results["study"] = {}
        await measure_study(corpus, cache, results["study"], saved)
        vector = results["service"]["modes"].get("vector") if "service" in results else None
        if vector and str(DEFAULT_CHUNK_SIZE) in results["study"]["variants"]:
            own = results["study"]["variants"][str(DEFAULT_CHUNK_SIZE)]
            results["study"]["default_agrees_with_service_vector"] = agreement(own, vector)
    results["texts_embedded_offline"] = cache.embedded_texts
    saved()
    return results


# --- the tables --------------------------------------------------------------------------------


def _cell(value: float | None) -> str:
    return "  -  " if value is None else f"{value:.3f}"


def _formats(results: dict[str, Any]) -> list[str]:
    return _in_order(results["questions_by_format"])


def tables(results: dict[str, Any]) -> str:
    """Format x system: hit@1/hit@5 (mrr@5 overall), then the citations, then the study."""
    if "service" not in results:  # --study-only
        return _study_table(results)
    formats = _formats(results)
    counts = results["questions_by_format"]
    rows: list[tuple[str, dict[str, Any]]] = [
        (f"service {mode}", m) for mode, m in results["service"]["modes"].items()
    ]
    rows.append(("langchain peer", results["peer"]))
    head = f"{'hit@1 / hit@5':<20} {'all':>17}" + "".join(f" {f'{f} ({counts[f]})':>13}" for f in formats)
    lines = [
        f"{results['questions']} questions, embedder {results['service']['embedder']}, top {results['top_k']};"
        f" service {results['service']['chunks']} chunks, peer {results['peer']['chunks']}",
        head,
    ]
    for name, m in rows:
        by = m["by_format"]
        lines.append(
            f"{name:<20} {_cell(m['hit@1'])}/{_cell(m['hit@5'])} m{_cell(m['mrr@5'])}"
            + "".join(f"  {_cell(by[f]['hit@1'])}/{_cell(by[f]['hit@5'])}" for f in formats)
        )
    lines += ["", f"{'cited@1 / when hit':<20} {'all':>11}" + "".join(f" {f:>13}" for f in formats)]
    for name, m in rows:
        by = m["by_format"]
        lines.append(
            f"{name:<20} {_cell(m['cited@1'])}/{_cell(m['cited_when_hit'])}"
            + "".join(f"  {_cell(by[f]['cited@1'])}/{_cell(by[f]['cited_when_hit'])}" for f in formats)
        )
    lines.append("")
    for mode, m in results["service"]["modes"].items():
        if "abstention" in m:
            a, point = m["abstention"], m["abstention"]["at_threshold"]
            lines.append(
                f"abstention {mode}: AUROC {a['auroc']:.3f} (best score median with the answer's document "
                f"{a['present_median']}, without {a['absent_median']}); min_score {point['threshold']}: "
                f"{point['present_answered']:.1%} answered, {point['absent_abstained']:.1%} without an answer abstained"
            )
    if results.get("study"):
        lines += ["", _study_table(results)]
    service = results["service"]
    for label, problems in (
        ("truth disagreements", results["truth_disagreements"]),
        ("passage text mismatches", service["text_mismatches"]),
        ("chunk count mismatches", service["chunk_count_mismatches"]),
        *((f"miscited hits, service {mode}", m["miscited"]) for mode, m in service["modes"].items()),
        ("miscited hits, peer", results["peer"]["miscited"]),
    ):
        if problems:
            lines.append(f"{label}: {len(problems)} (see the results file)")
    return "\n".join(lines)


def _study_table(results: dict[str, Any]) -> str:
    """The chunking study: per variant its chunks, their e5 tokens, and the vector ranker's hits."""
    formats = _formats(results)
    study = results["study"]
    window = study["window_tokens"]
    lines = [
        f"{'study (vector)':<14} {'chunks':>6} {'tokens':>6} {f'>{window}':>6}  {'hit@1':>5} {'hit@5':>5}"
        + "".join(f" {f + '@5':>8}" for f in formats),
    ]
    for name, v in study["variants"].items():
        lines.append(
            f"{name:<14} {v['chunks']:>6} {v.get('mean_tokens', '-'):>6} "
            f"{v.get(f'over_{window}_tokens', '-'):>6}  {_cell(v['hit@1'])} {_cell(v['hit@5'])}"
            + "".join(f" {_cell(v['by_format'][f]['hit@5']):>8}" for f in formats)
        )
    if "default_agrees_with_service_vector" in study:
        lines.append(
            f"(the {DEFAULT_CHUNK_SIZE}-word variant's ranks equal the service's vector mode's for"
            f" {study['default_agrees_with_service_vector']:.0%} of the questions)"
        )
    return "\n".join(lines)


# --- the command -------------------------------------------------------------------------------


def write(results: dict[str, Any], output: Path) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    began = time.perf_counter()
    async with bench_env() as env:
        await env.start_service()
        results = await run_document_quality(
            env,
            questions_file=args.questions,
            quick=args.quick,
            study=args.study,
            study_only=args.study_only,
            checkpoint=lambda partial: write(partial, args.output),
        )
    results["seconds_with_setup"] = round(time.perf_counter() - began, 1)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--questions", type=Path, default=QUESTIONS, help=f"question file (default {QUESTIONS.relative_to(ROOT)})")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help=f"skip documents over {QUICK_MAX_CHARS:,} characters; {QUICK_PER_DOCUMENT} questions a document")  # fmt: skip
    parser.add_argument("--study", action=argparse.BooleanOptionalAction, default=True, help="the chunking study (default: on)")  # fmt: skip
    parser.add_argument("--study-only", action="store_true", help="only the chunking study (not the service, not the peer)")  # fmt: skip
    parser.add_argument("--output", type=Path, default=OUTPUT, help=f"results file (default {OUTPUT.relative_to(ROOT)})")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of the tables")
    args = parser.parse_args()
    if not args.questions.is_file():
        parser.error(f"--questions {args.questions}: no such file")
    results = asyncio.run(run(args))
    write(results, args.output)
    print(json.dumps(results, indent=1, ensure_ascii=False) if args.json else tables(results))
    log(f"wrote {args.output}")
    sys.exit(0)


if __name__ == "__main__":
    main()
