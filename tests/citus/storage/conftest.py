"""The fixtures of tests/storage, for its tests re-run on Citus."""

from tests.storage.conftest import *  # noqa: F403
