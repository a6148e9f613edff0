"""The `tokensvc` command."""

from tokensvc.cli.main import main

__all__ = ["main"]
