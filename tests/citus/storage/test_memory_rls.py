"""tests/storage/test_memory_rls.py on Citus: row-level security on every shard.

Three tests look at how one node plans and locks the partitions of `memories` (partition names in
a plan, locks in pg_locks), which on Citus happens on the workers, where a plan names shards;
tests/citus/test_citus.py checks instead that every kind of search is a router query to one shard.
"""

from tests.storage.test_memory_rls import *  # noqa: F403

del test_every_kind_of_bucket_search_reads_one_partition  # noqa: F821
del test_repeated_bucket_statements_lock_one_partition_not_all  # noqa: F821
del test_a_partition_cannot_be_read_or_written_directly_even_by_its_tenant  # noqa: F821
