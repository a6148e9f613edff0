"""tests/api/test_data_subjects.py on Citus."""

from tests.api.test_data_subjects import *  # noqa: F403
