"""The conformance suite's fixtures, for its tests re-run on Citus."""

from tests.storage.conformance.conftest import *  # noqa: F403
