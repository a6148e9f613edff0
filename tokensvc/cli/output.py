"""How client commands print a response: proto JSON with `--json`, a readable line otherwise."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from google.protobuf import json_format

from tokensvc.v1 import common_pb2

__all__ = ["SEARCH_MODES", "add_search_mode", "draw_progress", "output"]


def draw_progress(
    args: argparse.Namespace, done: int, total: int, label: str, *, final: bool = False
) -> None:
    """A progress bar on stderr, redrawn in place, when it is a terminal and the output is text."""
    if args.json or not sys.stderr.isatty():
        return
    share = done / total if total else (1.0 if final else 0.0)
    bar = "#" * int(30 * min(share, 1.0))
    sys.stderr.write(f"\r[{bar:<30}] {done}/{total} {label:12}")
    if final:
        sys.stderr.write("\n")
    sys.stderr.flush()


def output(args: argparse.Namespace, response: Any, text: str) -> int:
    """Print `response` as JSON (field names as in the proto) or `text`; the exit code is 0."""
    if args.json:
        print(json.dumps(json_format.MessageToDict(response, preserving_proto_field_name=True)))
    else:
        print(text)
    return 0


SEARCH_MODES = {
    "hybrid": common_pb2.SEARCH_MODE_HYBRID,
    "vector": common_pb2.SEARCH_MODE_VECTOR,
    "text": common_pb2.SEARCH_MODE_TEXT,
}


def add_search_mode(parser: argparse.ArgumentParser) -> None:
    """`--mode hybrid|vector|text` of the search commands."""
    parser.add_argument(
        "--mode",
        choices=tuple(SEARCH_MODES),
        default="hybrid",
        help="hybrid (default): meaning and words fused; vector: meaning only; text: words only (BM25)",
    )
