"""tests/storage/test_knowledge_rls.py on Citus."""

from tests.storage.test_knowledge_rls import *  # noqa: F403
