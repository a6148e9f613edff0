"""tests/credentials/test_rotation.py on Citus."""

from tests.credentials.test_rotation import *  # noqa: F403
