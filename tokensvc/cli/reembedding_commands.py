"""`tokensvc admin migrate start|status|list|cancel|resume`: re-embedding migrations of memory
spaces and knowledge bases.

Called with the admin certificate by default (the control plane's works too: `--cert`, `--key`).
`start --wait` follows the migration to its end with a progress line and exits 1 unless it
succeeded; `--json` prints the responses for scripts.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from tokensvc.cli.connection import add_connection_flags, call_service
from tokensvc.cli.knowledge_commands import CHUNKING_KINDS
from tokensvc.cli.output import draw_progress, output
from tokensvc.v1 import knowledge_pb2, migration_pb2

__all__ = ["add_reembedding_commands"]

_FINAL = {migration_pb2.MIGRATION_PHASE_SUCCEEDED, migration_pb2.MIGRATION_PHASE_CANCELLED}


def add_reembedding_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    migrate = sub.add_parser(
        "migrate",
        help="move a memory space or a knowledge base to another embedder without downtime",
        description="Re-embedding migrations (MigrationService); docs/operations.md has the runbook.",
    )
    commands = migrate.add_subparsers(dest="migrate_command", required=True, metavar="COMMAND")
    start = commands.add_parser(
        "start", help="start (or --dry-run) a migration of one memory space or one knowledge base"
    )
    start.add_argument("--namespace", required=True, help="the memory space's or knowledge base's namespace")
    subject = start.add_mutually_exclusive_group(required=True)
    subject.add_argument("--agent", help="migrate this agent's memory space")
    subject.add_argument("--kb", metavar="REF", help="migrate this knowledge base")
    start.add_argument("--embedder", required=True, help="the target: a configured embedder's name")
    start.add_argument(
        "--chunking",
        choices=sorted(CHUNKING_KINDS),
        help="with --kb: re-chunk the documents with this strategy (default: keep the base's)",
    )
    start.add_argument(
        "--chunk-size", type=int, default=0, help="with --chunking: words per chunk (default 256)"
    )
    start.add_argument("--overlap", type=int, default=0, help="with --chunking: words shared by neighbours")
    start.add_argument("--dry-run", action="store_true", help="estimate only: rows, throughput, dimensions")
    start.add_argument("--wait", action="store_true", help="follow it to the end; exit 1 unless it succeeds")
    start.set_defaults(handler=_start)
    status = commands.add_parser("status", help="one migration and its progress")
    status.add_argument("id")
    status.set_defaults(handler=_status)
    listing = commands.add_parser("list", help="migrations, newest first")
    listing.add_argument("--page-size", type=int, default=50)
    listing.add_argument("--page-token", default="")
    listing.set_defaults(handler=_list)
    cancel = commands.add_parser("cancel", help="cancel a migration before its cutover")
    cancel.add_argument("id")
    cancel.set_defaults(handler=_cancel)
    resume = commands.add_parser("resume", help="resume a migration paused by embedder failures")
    resume.add_argument("id")
    resume.set_defaults(handler=_resume)
    for parser in (start, status, listing, cancel, resume):
        parser.add_argument("--json", action="store_true", help="print the response as JSON")
        add_connection_flags(parser)


def _call(args: argparse.Namespace, method: str, request: Any) -> Any:
    return call_service(args, "admin", "MigrationService", method, request)


def _phase(migration: migration_pb2.EmbeddingMigration) -> str:
    return migration_pb2.MigrationPhase.Name(migration.phase).removeprefix("MIGRATION_PHASE_").lower()


def _describe(m: migration_pb2.EmbeddingMigration) -> str:
    eta = f", about {m.eta_seconds:.0f} s left" if m.eta_seconds else ""
    rows = "memories"
    lines = [f"migration {m.id}: {_phase(m)}"]
    if m.HasField("knowledge_base"):
        rows = "documents"
        lines.append(f"  base:     {m.knowledge_base.namespace}/{m.knowledge_base.ref}")
    else:
        lines.append(f"  space:    {m.memory_space.namespace}/{m.memory_space.agent}")
    lines.append(
        f"  embedder: {m.source.name} ({m.source.dimension}) -> {m.target.name} ({m.target.dimension})"
    )
    if m.HasField("target_chunking") and m.target_chunking != m.source_chunking:
        lines.append(f"  chunking: {_chunking(m.source_chunking)} -> {_chunking(m.target_chunking)}")
    lines.append(f"  progress: {m.rows_done}/{m.rows_total} {rows}, {m.rows_per_second:.1f}/s{eta}")
    if m.reason:
        lines.append(f"  reason:   {m.reason}")
    return "\n".join(lines)


def _chunking(strategy: knowledge_pb2.ChunkingStrategy) -> str:
    kind = knowledge_pb2.ChunkingKind.Name(strategy.kind).removeprefix("CHUNKING_KIND_").lower()
    return f"{kind} ({strategy.chunk_size}/{strategy.chunk_overlap})"


def _start(args: argparse.Namespace) -> int:
    request = migration_pb2.StartEmbeddingMigrationRequest(embedder=args.embedder, dry_run=args.dry_run)
    if args.kb is not None:
        request.knowledge_base.CopyFrom(migration_pb2.KnowledgeBaseRef(namespace=args.namespace, ref=args.kb))
    else:
        request.memory_space.CopyFrom(
            migration_pb2.MemorySpaceRef(namespace=args.namespace, agent=args.agent)
        )
    if args.chunking is not None:
        if args.kb is None:
            raise SystemExit("tokensvc: --chunking needs --kb (only a knowledge base is chunked)")
        request.chunking.CopyFrom(
            knowledge_pb2.ChunkingStrategy(
                kind=CHUNKING_KINDS[args.chunking], chunk_size=args.chunk_size, chunk_overlap=args.overlap
            )
        )
    response = _call(args, "StartEmbeddingMigration", request)
    e = response.estimate
    text = (
        f"{e.rows} {'documents' if args.kb is not None else 'memories'}, {e.source.name} "
        f"({e.source.dimension}) -> {e.target.name} "
        f"({e.target.dimension}); the target embeds {e.embedder_items_per_second:.1f}/s: "
        f"about {e.estimated_seconds:.0f} s"
    )
    if response.HasField("migration"):
        text += "\n" + _describe(response.migration)
    if args.wait and response.HasField("migration"):
        if not args.json:  # with --json, only the migration as it ended is printed
            output(args, response, text)
        return _follow(args, response.migration.id)
    return output(args, response, text)


def _follow(args: argparse.Namespace, migration_id: str) -> int:
    """Poll until the migration ends, drawing a progress line on a terminal; 0 only if it succeeded."""
    request = migration_pb2.GetEmbeddingMigrationRequest(id=migration_id)
    while True:
        migration = _call(args, "GetEmbeddingMigration", request).migration
        ended = migration.phase in _FINAL or migration.phase == migration_pb2.MIGRATION_PHASE_PAUSED
        draw_progress(args, migration.rows_done, migration.rows_total, _phase(migration), final=ended)
        if ended:
            output(args, migration, _describe(migration))
            return 0 if migration.phase == migration_pb2.MIGRATION_PHASE_SUCCEEDED else 1
        time.sleep(1.0)


def _status(args: argparse.Namespace) -> int:
    response = _call(args, "GetEmbeddingMigration", migration_pb2.GetEmbeddingMigrationRequest(id=args.id))
    return output(args, response, _describe(response.migration))


def _list(args: argparse.Namespace) -> int:
    response = _call(
        args,
        "ListEmbeddingMigrations",
        migration_pb2.ListEmbeddingMigrationsRequest(page_size=args.page_size, page_token=args.page_token),
    )
    lines = [_describe(m) for m in response.migrations]
    if response.next_page_token:
        lines.append(f"(more: --page-token {response.next_page_token})")
    return output(args, response, "\n".join(lines) or "(no migrations)")


def _cancel(args: argparse.Namespace) -> int:
    response = _call(
        args, "CancelEmbeddingMigration", migration_pb2.CancelEmbeddingMigrationRequest(id=args.id)
    )
    return output(args, response, _describe(response.migration))


def _resume(args: argparse.Namespace) -> int:
    response = _call(
        args, "ResumeEmbeddingMigration", migration_pb2.ResumeEmbeddingMigrationRequest(id=args.id)
    )
    return output(args, response, _describe(response.migration))
