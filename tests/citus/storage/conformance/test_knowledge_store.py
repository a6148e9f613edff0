"""tests/storage/conformance/test_knowledge_store.py on Citus."""

from tests.storage.conformance.test_knowledge_store import *  # noqa: F403
