"""tests/storage/conformance/test_embedding_migrations.py on Citus."""

from tests.storage.conformance.test_embedding_migrations import *  # noqa: F403
