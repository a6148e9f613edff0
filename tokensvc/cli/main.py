"""Entry point of the `tokensvc` command: argument parsing and readable errors."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tokensvc import __version__
from tokensvc.cli.admin_commands import add_admin_commands
from tokensvc.cli.capability_commands import add_capability_commands
from tokensvc.cli.client_commands import add_client_commands
from tokensvc.cli.connection import RpcFailed
from tokensvc.cli.knowledge_commands import add_knowledge_commands
from tokensvc.cli.memory_commands import add_memory_commands
from tokensvc.cli.server_commands import add_server_commands

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokensvc",
        description="tokensvc: the ctxmesh token and long-term memory service.",
    )
    parser.add_argument("--version", action="version", version=f"tokensvc {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_server_commands(commands)
    add_client_commands(commands)
    add_capability_commands(commands)
    add_memory_commands(commands)
    add_knowledge_commands(commands)
    add_admin_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from tokensvc.logs import configure_logging

    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging()
    try:
        code: int = args.handler(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        message = _readable(exc)
        if message is None:
            raise
        print(f"tokensvc: error: {message}", file=sys.stderr)
        # 1: the service answered with an error; 2: we could not even make the call.
        return 1 if isinstance(exc, RpcFailed) else 2
    return code


def _readable(exc: Exception) -> str | None:
    """The message of an error we expect users to hit; None for a bug (show the traceback)."""
    from tokensvc.auth.devpki import DevMaterialError
    from tokensvc.cli.connection import ConnectionError_, RpcFailed
    from tokensvc.errors import TokensvcError
    from tokensvc.settings import SettingsError
    from tokensvc.storage.postgres import EmbeddedPostgresError, SchemaMigrationError

    if isinstance(
        exc,
        SettingsError
        | ConnectionError_
        | RpcFailed
        | DevMaterialError
        | EmbeddedPostgresError
        | SchemaMigrationError,
    ):
        return str(exc)
    if isinstance(exc, TokensvcError):
        return exc.message
    if isinstance(exc, ValueError | OSError):
        return str(exc)
    from tokensvc.app import SchemaOutdated

    if isinstance(exc, SchemaOutdated):
        return str(exc)
    return None


if __name__ == "__main__":
    sys.exit(main())
