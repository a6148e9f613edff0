"""tests/api/test_knowledge_migration.py on Citus: a knowledge base re-embedded and re-chunked
while it serves, cancelled, and refused with the field named."""

from tests.api.test_knowledge_migration import *  # noqa: F403
