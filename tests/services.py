"""Moved to tests/e2e/services.py, where the end-to-end suite uses it; ``tests.services`` stays importable for
the benchmarks in bench/ and for code written against the old layout."""

from tests.e2e.services import *  # noqa: F403
