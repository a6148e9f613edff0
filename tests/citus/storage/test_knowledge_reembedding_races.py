"""tests/storage/test_knowledge_reembedding_races.py on Citus: the runner's batches, uploads,
metadata changes, cutovers and deletions of one knowledge base, ordered without deadlocks."""

from tests.storage.test_knowledge_reembedding_races import *  # noqa: F403
