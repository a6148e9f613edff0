"""tests/storage/conformance/test_memory_reads.py on Citus."""

from tests.storage.conformance.test_memory_reads import *  # noqa: F403
