"""tests/storage/conformance/test_memory_writes.py on Citus."""

from tests.storage.conformance.test_memory_writes import *  # noqa: F403
