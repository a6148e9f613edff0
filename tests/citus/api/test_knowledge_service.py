"""tests/api/test_knowledge_service.py on Citus."""

from tests.api.test_knowledge_service import *  # noqa: F403
