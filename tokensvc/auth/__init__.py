"""Caller identity, capabilities, key sets and buckets."""

__all__: list[str] = []
