"""Moved to tests/e2e/postgres.py, where the end-to-end suite uses it; ``tests.postgres`` stays importable for
the benchmarks in bench/ and for code written against the old layout."""

from tests.e2e.postgres import *  # noqa: F403
