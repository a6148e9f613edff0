"""tests/storage/conformance/test_memory_statistics.py on Citus."""

from tests.storage.conformance.test_memory_statistics import *  # noqa: F403
