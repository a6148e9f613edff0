"""tests/storage/test_vector_indexes.py on Citus: a first write of a new dimension starts its
index on a real coordinator (32 shards per partition, on both workers) and the duty finishes it.

The half-built second-slot test is left out: it runs the same build again (minutes on Citus), and
what it adds, reading the catalogue's names, is the same on both engines.
"""

from tests.storage.test_vector_indexes import *  # noqa: F403

del test_finish_completes_a_half_built_second_slot_index_and_ignores_other_indexes  # noqa: F821
