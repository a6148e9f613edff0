"""tests/api/test_capability_service.py on Citus."""

from tests.api.test_capability_service import *  # noqa: F403
