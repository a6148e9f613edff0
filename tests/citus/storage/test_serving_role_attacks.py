"""tests/storage/test_serving_role_attacks.py on Citus: the serving role's and the runner role's
refusals (migration 0021) hold on a coordinator, whose reference and distributed tables carry
the same grants and policies.

Three tests are left out: their raw serving connection declares a tenant with `set_config`, which
reaches the coordinator only (tokensvc's own connections carry the declaration to the workers,
docs/scaling.md), so on Citus their reads and pins fail for the undeclared tenant, not for what
they test; and the partitions test names partitions of one node.
"""

from tests.storage.test_serving_role_attacks import *  # noqa: F403

del test_a_forged_migration_cannot_re_pin_a_space_or_empty_its_vectors  # noqa: F821
del test_pins_the_serving_role_makes_up_get_indexes_for_16_dimensions_at_most  # noqa: F821
del test_partitions_and_statistics_show_no_bucket  # noqa: F821
