"""The pass cache and the one-transaction pass write on a real PostgreSQL: the store-level tests of
tests/unit/test_store_cache.py (on SQLite there), collected here with a PostgreSQL ``url``. Two `Store`
objects on one database stand for two processes; PostgreSQL reads each statement at its own snapshot, so
a change committed between a pass's generation statement and its reads must still be seen next pass."""

import itertools

import pytest

from tests.harness.postgres import PostgresServer
from tests.unit import test_store_cache as on_sqlite

_names = itertools.count()


@pytest.fixture(scope="module")
def pg():
    with PostgresServer(timezone="Pacific/Chatham") as server:  # not UTC: timestamps must not shift
        yield server


@pytest.fixture
def url(pg) -> str:
    return pg.create_database(f"cache{next(_names)}")


test_an_unchanged_pass_reads_no_baseline_or_calibration_row = (
    on_sqlite.test_an_unchanged_pass_reads_no_baseline_or_calibration_row
)
test_a_baseline_accepted_through_another_store_is_used_by_the_next_pass = (
    on_sqlite.test_a_baseline_accepted_through_another_store_is_used_by_the_next_pass
)
test_a_calibration_saved_or_dropped_through_another_store_is_used_by_the_next_pass = (
    on_sqlite.test_a_calibration_saved_or_dropped_through_another_store_is_used_by_the_next_pass
)
test_a_prune_through_another_store_loses_and_corrupts_nothing_of_the_next_pass = (
    on_sqlite.test_a_prune_through_another_store_loses_and_corrupts_nothing_of_the_next_pass
)
test_a_pass_writes_in_one_transaction_and_a_refused_observation_costs_only_itself = (
    on_sqlite.test_a_pass_writes_in_one_transaction_and_a_refused_observation_costs_only_itself
)
