"""tests/storage/conformance/test_memory_search.py on Citus."""

from tests.storage.conformance.test_memory_search import *  # noqa: F403
