"""tests/storage/test_serving_role_attacks.py on Citus: the serving role's and the runner role's
refusals (migration 0021) hold on a coordinator, whose reference and distributed tables carry
the same grants and policies."""

from tests.storage.test_serving_role_attacks import *  # noqa: F403
