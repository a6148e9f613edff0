"""tests/api/test_admin_service.py on Citus."""

from tests.api.test_admin_service import *  # noqa: F403
