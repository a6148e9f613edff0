"""tests/api/test_memory_service.py on Citus."""

from tests.api.test_memory_service import *  # noqa: F403
