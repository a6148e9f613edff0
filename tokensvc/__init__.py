"""tokensvc: the ctxmesh token and long-term memory service."""

__version__ = "0.1.0"
