"""tests/storage/conformance/test_knowledge_migrations.py on Citus."""

from tests.storage.conformance.test_knowledge_migrations import *  # noqa: F403
