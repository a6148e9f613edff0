"""tests/storage/conformance/test_ledgers.py on Citus."""

from tests.storage.conformance.test_ledgers import *  # noqa: F403
