"""tests/storage/conformance/test_ingestion_leases.py on Citus."""

from tests.storage.conformance.test_ingestion_leases import *  # noqa: F403
