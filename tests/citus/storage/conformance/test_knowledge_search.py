"""tests/storage/conformance/test_knowledge_search.py on Citus."""

from tests.storage.conformance.test_knowledge_search import *  # noqa: F403
