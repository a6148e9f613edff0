"""tests/storage/test_reembedding_races.py on Citus: a cutover ordered with a write of its space."""

from tests.storage.test_reembedding_races import *  # noqa: F403
