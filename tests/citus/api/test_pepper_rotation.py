"""tests/api/test_pepper_rotation.py on Citus."""

from tests.api.test_pepper_rotation import *  # noqa: F403
