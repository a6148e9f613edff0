"""tests/storage/conformance/test_ingestion_views.py on Citus."""

from tests.storage.conformance.test_ingestion_views import *  # noqa: F403
