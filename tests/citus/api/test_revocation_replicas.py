"""tests/api/test_revocation_replicas.py on Citus."""

from tests.api.test_revocation_replicas import *  # noqa: F403
