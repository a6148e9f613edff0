"""The fixtures of tests/api, for its tests re-run on Citus."""

from tests.api.conftest import *  # noqa: F403
