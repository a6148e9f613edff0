"""tests/storage/test_memory_rls.py on Citus: row-level security on every shard."""

from tests.storage.test_memory_rls import *  # noqa: F403
