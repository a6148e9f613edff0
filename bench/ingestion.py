"""Background ingestion's throughput against the embedder alone on the same chunks (issue 37).

    .venv/bin/python -m bench.ingestion [--documents NAME ...] [--rounds 2]

Third-party documents (tests/knowledge/fixtures/documents, MANIFEST.tsv: a PDF manual from a Debian
documentation package, and DOCX and PPTX files generated from a Debian manual page) are uploaded
into a knowledge base pinned to the embedded default model (markdown chunking, 256 words), without
waiting; the service's background runner extracts, chunks, embeds and finishes them. Measured in
the same run, alternating, `--rounds` times:

- the embedder alone: the same chunks (extracted and chunked here exactly as the server does)
  embedded in batches of the embedder's own size at the bulk class, one batch after another, with
  the service idle: the floor ingestion is compared with;
- ingestion: from the first upload's start to the moment every version is READY (ListDocuments
  polled every 0.2 s), chunks per second. Each round uploads the documents under new refs.

The ratio ingestion / embedder alone is the issue's target (>= 0.8). Results go to
bench/results/ingestion.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

from bench.client import mtls_channel
from bench.env import NAMESPACE, bench_env
from tokensvc.embedders import Demand, WorkClass
from tokensvc.knowledge.chunking import ChunkingStrategy, chunk_document
from tokensvc.knowledge.formats import extract_document
from tokensvc.knowledge.formats.documents import ExtractionLimits
from tokensvc.knowledge.formats.media_types import media_type_for_filename
from tokensvc.retrieval import batch_size_of
from tokensvc.v1 import knowledge_pb2, knowledge_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DOCUMENTS = ROOT / "tests" / "knowledge" / "fixtures" / "documents"
DEFAULT_DOCUMENTS = (
    "r-intro.pdf",
    "git-manual.docx",
    "git-manual-slides.pptx",
    "live-manual-landscape-en.pdf",
)
MODEL = "multilingual-e5-small"
STRATEGY = ChunkingStrategy.from_stored("markdown", 256, 0)
PIECE = 1024 * 1024


def log(message: str) -> None:
    print(f"[ingestion {time.strftime('%H:%M:%S')}] {message}", flush=True)


def chunk_texts(names: list[str]) -> list[str]:
    """The chunks the server cuts from these documents (the same extraction and chunker)."""
    texts: list[str] = []
    for name in names:
        media_type = media_type_for_filename(name)
        assert media_type is not None, name
        document = extract_document((DOCUMENTS / name).read_bytes(), media_type, ExtractionLimits())
        texts += [chunk.text for chunk in chunk_document(document.text, STRATEGY)]
    return texts


async def embedder_alone(embedder: Any, texts: list[str]) -> float:
    """Chunks per second the embedder embeds in batches of its own size, one after another."""
    size = batch_size_of(embedder)
    demand = Demand.of(WorkClass.BULK, "bench")  # ingestion's class
    began = time.perf_counter()
    for start in range(0, len(texts), size):
        await embedder.embed_documents(texts[start : start + size], demand)
    return len(texts) / (time.perf_counter() - began)


async def ingest(
    manager: knowledge_pb2_grpc.KnowledgeServiceStub, kb: str, names: list[str]
) -> tuple[int, float]:
    """Upload the documents without waiting; (chunks, seconds) until every version is READY."""
    began = time.perf_counter()
    for name in names:
        content = (DOCUMENTS / name).read_bytes()
        header = knowledge_pb2.UploadDocumentHeader(
            namespace=NAMESPACE,
            knowledge_base_ref=kb,
            document_ref=name,
            content_type=media_type_for_filename(name) or "application/octet-stream",
        )
        messages = [knowledge_pb2.UploadDocumentRequest(header=header)] + [
            knowledge_pb2.UploadDocumentRequest(content=content[start : start + PIECE])
            for start in range(0, len(content), PIECE)
        ]
        uploaded = await manager.UploadDocument(iter(messages), timeout=120)
        assert uploaded.document.state == knowledge_pb2.DOCUMENT_STATE_PENDING, uploaded
    while True:
        listed = await manager.ListDocuments(
            knowledge_pb2.ListDocumentsRequest(namespace=NAMESPACE, knowledge_base_ref=kb, page_size=100),
            timeout=60,
        )
        states = {d.state for d in listed.documents}
        if knowledge_pb2.DOCUMENT_STATE_FAILED in states:
            raise RuntimeError(f"a document failed: {[d.failure_reason for d in listed.documents]}")
        if len(listed.documents) == len(names) and states == {knowledge_pb2.DOCUMENT_STATE_READY}:
            return sum(d.chunk_count for d in listed.documents), time.perf_counter() - began
        await asyncio.sleep(0.2)


async def run(names: list[str], rounds: int) -> dict[str, Any]:
    texts = chunk_texts(names)
    log(f"{len(names)} documents, {len(texts)} chunks, {sum(len(t) for t in texts) / 1024:.0f} KiB of text")
    async with bench_env() as env:
        service = await env.start_service()
        assert service.embedders is not None
        embedder = service.embedders.get(MODEL)
        await embedder.embed_documents(texts[:4], Demand.of(WorkClass.BULK, "bench"))  # warm
        channel = mtls_channel(
            service.port,
            env.dev.ca_cert.read_bytes(),
            *(p.read_bytes() for p in env.dev.client("control-plane")),
        )
        manager = knowledge_pb2_grpc.KnowledgeServiceStub(channel)
        alone: list[float] = []
        ingested: list[float] = []
        try:
            for round_ in range(rounds):
                alone.append(await embedder_alone(embedder, texts))
                log(f"round {round_ + 1}: the embedder alone {alone[-1]:.2f} chunks/s")
                kb = f"bench-{uuid.uuid4().hex[:8]}"
                await manager.CreateKnowledgeBase(
                    knowledge_pb2.CreateKnowledgeBaseRequest(
                        namespace=NAMESPACE,
                        ref=kb,
                        embedder=MODEL,
                        chunking=knowledge_pb2.ChunkingStrategy(kind=knowledge_pb2.CHUNKING_KIND_MARKDOWN),
                    ),
                    timeout=60,
                )
                chunks, seconds = await ingest(manager, kb, names)
                assert chunks == len(texts), (chunks, len(texts))
                ingested.append(chunks / seconds)
                log(
                    f"round {round_ + 1}: ingestion {chunks} chunks in {seconds:.1f} s = {ingested[-1]:.2f}/s"
                )
        finally:
            await channel.close(grace=None)
    ratios = [i / a for i, a in zip(ingested, alone, strict=True)]
    return {
        "documents": names,
        "chunks": len(texts),
        "text_kib": round(sum(len(t) for t in texts) / 1024, 1),
        "embedder": MODEL,
        "batch_size": batch_size_of(embedder),
        "embedder_alone_chunks_per_s": [round(a, 2) for a in alone],
        "ingestion_chunks_per_s": [round(i, 2) for i in ingested],
        "ingestion_over_embedder_alone": [round(r, 3) for r in ratios],
        "ingestion_over_embedder_alone_median": round(statistics.median(ratios), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", nargs="+", default=list(DEFAULT_DOCUMENTS), help="fixture file names")
    parser.add_argument("--rounds", type=int, default=2, help="alternating measurements of each (default 2)")
    parser.add_argument("--out", type=Path, default=RESULTS / "ingestion.json")
    args = parser.parse_args()
    results = asyncio.run(run(args.documents, args.rounds))
    args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    log(f"ratio ingestion / embedder alone: {results['ingestion_over_embedder_alone_median']} -> {args.out}")


if __name__ == "__main__":
    main()
