"""tests/api/test_knowledge_roster.py on Citus."""

from tests.api.test_knowledge_roster import *  # noqa: F403
