"""tests/storage/test_vector_indexes.py on Citus: a first write of a new dimension starts its
index on a real coordinator (32 shards per partition, on both workers) and the duty finishes it.

The two tests of a half-built index (a running service's duty finishes it; the catalogue's names
of a second-slot index) are left out: each runs the same build again, minutes on Citus, and what
they add (the duty's wiring, reading the names) is the same on both engines.
"""

from tests.storage.test_vector_indexes import *  # noqa: F403

del test_a_running_service_finishes_a_build_a_stopped_replica_left  # noqa: F821
del test_finish_completes_a_half_built_second_slot_index_and_ignores_other_indexes  # noqa: F821
