"""tests/api/test_memory_ranking.py on Citus."""

from tests.api.test_memory_ranking import *  # noqa: F403
