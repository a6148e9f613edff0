"""tests/api/test_embedding_migration.py on Citus: a memory space re-embedded while it serves,
cancelled mid-way, refused with the field named, and driven from the CLI."""

from tests.api.test_embedding_migration import *  # noqa: F403
