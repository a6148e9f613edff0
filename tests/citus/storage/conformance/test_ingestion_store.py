"""tests/storage/conformance/test_ingestion_store.py on Citus."""

from tests.storage.conformance.test_ingestion_store import *  # noqa: F403
