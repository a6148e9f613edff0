"""`tokensvc memory remember|search|list|forget|forget-all` — long-term memory as the launcher."""

from __future__ import annotations

import argparse
from typing import Any

from google.protobuf import duration_pb2, json_format

from tokensvc.cli.capability_commands import add_capability_source, read_capability
from tokensvc.cli.connection import add_connection_flags, call_service
from tokensvc.cli.output import SEARCH_MODES, add_search_mode, output
from tokensvc.v1 import common_pb2, memory_pb2

__all__ = ["add_memory_commands", "parse_metadata"]


def add_memory_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    memory = commands.add_parser("memory", help="long-term memory of the capability's agent")
    sub = memory.add_subparsers(dest="memory_command", required=True, metavar="COMMAND")

    remember = sub.add_parser("remember", help="store a fact", description="Call MemoryService.Remember.")
    remember.add_argument("text", metavar="TEXT")
    remember.add_argument(
        "--metadata",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="metadata; true/false become booleans, numbers become numbers (repeatable)",
    )
    remember.add_argument("--ttl", type=int, metavar="SECONDS", help="expire after this long")
    remember.add_argument("--idempotency-key", help="makes a retry return the same memory")
    remember.set_defaults(handler=_remember)

    search = sub.add_parser(
        "search", help="recall by meaning", description="Call MemoryService.SearchMemories."
    )
    search.add_argument("query", metavar="QUERY")
    search.add_argument("-k", "--top-k", type=int, default=10, help="results (1..100, default 10)")
    add_search_mode(search)
    search.add_argument("--min-score", type=float, help="drop results scoring below this")
    search.add_argument(
        "--filter",
        metavar="JSON",
        help='a tokensvc.v1.Filter in proto JSON, e.g. \'{"field": {"key": "topic", '
        '"operator": "FILTER_OPERATOR_EQ", "value": {"stringValue": "prefs"}}}\'',
    )
    search.set_defaults(handler=_search)

    listing = sub.add_parser("list", help="list memories, newest first", description="Call ListMemories.")
    listing.add_argument("--page-size", type=int, default=50)
    listing.add_argument("--page-token", default="")
    listing.add_argument("--filter", metavar="JSON", help="a tokensvc.v1.Filter in proto JSON")
    listing.set_defaults(handler=_list)

    forget = sub.add_parser("forget", help="delete memories by id", description="Call MemoryService.Forget.")
    forget.add_argument("ids", nargs="+", metavar="ID")
    forget.set_defaults(handler=_forget)

    forget_all = sub.add_parser(
        "forget-all", help="delete everything in this caller's bucket", description="Call ForgetAll."
    )
    forget_all.set_defaults(handler=_forget_all)

    for parser in (remember, search, listing, forget, forget_all):
        add_capability_source(parser)
        parser.add_argument("--json", action="store_true", help="print the response as JSON")
        add_connection_flags(parser)


def parse_metadata(pairs: list[str]) -> dict[str, common_pb2.MetadataValue]:
    metadata: dict[str, common_pb2.MetadataValue] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--metadata {pair!r}: expected KEY=VALUE")
        metadata[key] = _metadata_value(raw)
    return metadata


def _metadata_value(raw: str) -> common_pb2.MetadataValue:
    if raw in ("true", "false"):
        return common_pb2.MetadataValue(bool_value=raw == "true")
    try:
        return common_pb2.MetadataValue(number_value=float(raw))
    except ValueError:
        return common_pb2.MetadataValue(string_value=raw)


def _filter(raw: str | None) -> common_pb2.Filter | None:
    if raw is None:
        return None
    try:
        return json_format.Parse(raw, common_pb2.Filter())
    except json_format.ParseError as exc:
        raise ValueError(f"--filter: not a tokensvc.v1.Filter in proto JSON ({exc})") from None


def _call(args: argparse.Namespace, method: str, request: Any) -> Any:
    token = read_capability(args)
    return call_service(args, "launcher", "MemoryService", method, request, token)


def _remember(args: argparse.Namespace) -> int:
    item = memory_pb2.RememberItem(
        content=args.text, metadata=parse_metadata(args.metadata), idempotency_key=args.idempotency_key or ""
    )
    if args.ttl is not None:
        item.ttl.CopyFrom(duration_pb2.Duration(seconds=args.ttl))
    response = _call(args, "Remember", memory_pb2.RememberRequest(items=[item]))
    result = response.results[0]
    return output(args, response, f"{result.id}{' (already remembered)' if result.deduplicated else ''}")


def _search(args: argparse.Namespace) -> int:
    request = memory_pb2.SearchMemoriesRequest(
        query_text=args.query,
        top_k=args.top_k,
        mode=SEARCH_MODES[args.mode],
    )
    if args.min_score is not None:
        request.min_score = args.min_score
    if (filter_ := _filter(args.filter)) is not None:
        request.filter.CopyFrom(filter_)
    response = _call(args, "SearchMemories", request)
    lines = [f"{r.score:.4f}  {r.memory.id}  {r.memory.content}" for r in response.results]
    return output(args, response, "\n".join(lines) or "(no memories found)")


def _list(args: argparse.Namespace) -> int:
    request = memory_pb2.ListMemoriesRequest(page_size=args.page_size, page_token=args.page_token)
    if (filter_ := _filter(args.filter)) is not None:
        request.filter.CopyFrom(filter_)
    response = _call(args, "ListMemories", request)
    lines = [f"{m.created_at.ToJsonString()}  {m.id}  {m.content}" for m in response.memories]
    if response.next_page_token:
        lines.append(f"(more: --page-token {response.next_page_token})")
    return output(args, response, "\n".join(lines) or "(no memories)")


def _forget(args: argparse.Namespace) -> int:
    response = _call(args, "Forget", memory_pb2.ForgetRequest(ids=args.ids))
    return output(args, response, f"forgot {response.forgotten_count}")


def _forget_all(args: argparse.Namespace) -> int:
    response = _call(args, "ForgetAll", memory_pb2.ForgetAllRequest())
    return output(args, response, f"forgot {response.forgotten_count}")
