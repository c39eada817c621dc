"""Moved to tests/e2e/faultproxy.py, where the end-to-end suite uses it; ``tests.faultproxy`` stays
importable for the benchmarks in bench/ and for code written against the old layout."""

from tests.e2e.faultproxy import *  # noqa: F403
