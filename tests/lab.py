"""Moved to tests/e2e/lab.py, where the end-to-end suite uses it; ``tests.lab`` stays importable for
the benchmarks in bench/ and for code written against the old layout."""

from tests.e2e.lab import *  # noqa: F403
