"""tests/storage/test_text_statistics.py on Citus: the statistics counted on a shard, the ranker reading them."""

from tests.storage.test_text_statistics import *  # noqa: F403
