"""tests/api/test_memory_isolation.py on Citus."""

from tests.api.test_memory_isolation import *  # noqa: F403
