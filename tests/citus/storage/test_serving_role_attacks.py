"""tests/storage/test_serving_role_attacks.py on Citus: the serving role's and the runner role's
refusals (migration 0021) hold on a coordinator, whose reference and distributed tables carry
the same grants and policies. The suite's raw connections are of the class tokensvc's pools use
there and declare a tenant as tokensvc does, so the workers' policies see the declaration.
"""

from tests.storage.test_serving_role_attacks import *  # noqa: F403
