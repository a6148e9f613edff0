"""A large corpus of distinct third-party chunks: Debian documentation packages, chunked as the service does.

    .venv/bin/python -m bench.debian_corpus [--chunks 110000]

A large knowledge base built by repeating a small document set has the wrong term statistics for
judging a text ranker: every term is that many times as common, and every chunk has that many
twins, so any approximation of BM25 looks exact. This corpus is made of the packages' own
documents (manuals, API references, kernel documentation), extracted and cut into 256-word chunks
by the service's extractor and chunker, each distinct text once, in a fixed order.

The packages come from the Debian archive by `apt-get download` (a bench-time download, never the
service's) into `bench/.cache/debian/`, and each package's chunks are kept there as gzipped JSON
lines, so the work is done once per machine (~25 min for all of them). None of these packages is one the independent check uses.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tokensvc.errors import InvalidArgument
from tokensvc.knowledge.chunking import ChunkingStrategy, chunk_document
from tokensvc.knowledge.formats import extract_document

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "bench" / ".cache" / "debian"
STRATEGY = ChunkingStrategy.from_stored("markdown", 256, 0)


@dataclass(frozen=True)
class Source:
    """One package's documents: the files under `under` whose names end with a suffix of `kinds`."""

    package: str
    under: str
    kinds: tuple[tuple[str, str], ...]  # (file name suffix, media type the text is read as)


# Prose first (manuals), then references; each package's files in path order.
SOURCES = (
    Source("postgresql-doc-15", "usr/share/doc/postgresql-doc-15/html", ((".html", "text/html"),)),
    Source("python3.11-doc", "usr/share/doc/python3.11/html/_sources", ((".rst.txt", "text/plain"),)),
    Source("perl-doc", "usr/share/perl", ((".pod", "text/plain"),)),
    Source(
        "linux-doc-6.1",
        "usr/share/doc/linux-doc-6.1/Documentation",
        ((".rst.gz", "text/plain"), (".txt.gz", "text/plain")),
    ),
    Source("git-doc", "usr/share/doc/git-doc", ((".txt", "text/plain"),)),
    Source("gimp-help-en", "usr/share/gimp/2.0/help/en", ((".html", "text/html"),)),
    Source("rust-doc", "usr/share/doc/rust-doc/html", ((".html", "text/html"),)),
    Source("openjdk-17-doc", "usr/share/doc/openjdk-17-jre-headless/api", ((".html", "text/html"),)),
)


def log(message: str) -> None:
    print(f"[debian-corpus {time.strftime('%H:%M:%S')}] {message}", flush=True)


def tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise SystemExit(f"{name} not found: this corpus comes from Debian packages")
    return found


def unpacked(package: str) -> Path:
    """The package's files, downloaded and unpacked into the cache when missing."""
    target = CACHE / "packages" / package
    if (target / ".done").exists():
        return target
    downloads = CACHE / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    if not list(downloads.glob(f"{package}_*.deb")):
        log(f"apt-get download {package}")
        subprocess.run([tool("apt-get"), "download", package], cwd=downloads, check=True, capture_output=True)
    (deb,) = downloads.glob(f"{package}_*.deb")
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run([tool("dpkg-deb"), "-x", str(deb), str(target)], check=True)
    (target / ".done").touch()
    return target


def documents(source: Source) -> Iterator[tuple[bytes, str]]:
    """The source's documents as (bytes, media type), in path order."""
    root = unpacked(source.package) / source.under
    if not root.is_dir():
        raise SystemExit(f"{source.package} has no {source.under}: the package's layout changed")
    for path in sorted(root.rglob("*")):
        for suffix, media_type in source.kinds:
            if path.is_file() and path.name.endswith(suffix):
                data = path.read_bytes()
                yield (gzip.decompress(data) if suffix.endswith(".gz") else data), media_type
                break


def source_chunks(source: Source) -> Iterator[str]:
    """The source's chunk texts of at least 20 words, in order (cached per source)."""
    cached = CACHE / f"{source.package}-{STRATEGY.chunk_size}.jsonl.gz"
    if not cached.exists():
        CACHE.mkdir(parents=True, exist_ok=True)  # a fresh machine has no cache yet
        partial = cached.with_suffix(".partial")
        count = refused = 0
        with gzip.open(partial, "wt") as out:
            for data, media_type in documents(source):
                try:
                    text = extract_document(data, media_type).text
                except InvalidArgument:  # refused by the extractor (e.g. no text): left out
                    refused += 1
                    continue
                for chunk in chunk_document(text, STRATEGY):
                    if len(chunk.text.split()) >= 20:
                        out.write(json.dumps(chunk.text) + "\n")
                        count += 1
        partial.rename(cached)
        log(f"{source.package}: {count} chunks ({refused} documents refused)")
    with gzip.open(cached, "rt") as lines:
        for line in lines:
            yield json.loads(line)


def chunks(count: int) -> list[str]:
    """The first `count` distinct chunk texts of the sources, in order (built on first use)."""
    seen: set[str] = set()
    texts: list[str] = []
    for source in SOURCES:
        for text in source_chunks(source):
            if text not in seen:
                seen.add(text)
                texts.append(text)
                if len(texts) == count:
                    return texts
    raise SystemExit(f"the corpus holds {len(texts)} distinct chunks, not {count}: add a source")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=110_000, help="how many to check for (default 110000)")
    args = parser.parse_args()
    texts = chunks(args.chunks)
    words = sum(len(text.split()) for text in texts)
    log(f"{len(texts)} distinct chunks, {words:,} words")


if __name__ == "__main__":
    main()
