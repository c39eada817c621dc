"""Alembic migrations on a real PostgreSQL (tests/harness/postgres.py; missing binaries fail the tests, never
skip them): the same tests as on SQLite, collected here from tests/unit/test_migrations.py with a
PostgreSQL ``url``, and the requirement that the server binaries are there.
"""

import itertools

import pytest

from tests.harness.postgres import PostgresServer
from tests.unit import test_configurations
from tests.unit import test_migrations as on_sqlite

_names = itertools.count()


@pytest.fixture(scope="module")
def pg():
    with PostgresServer() as server:
        yield server


@pytest.fixture
def url(pg) -> str:
    return pg.create_database(f"mig{next(_names)}")


# The SQLite tests, collected again: pytest gives them this module's ``url``, a PostgreSQL database.
test_migrated_schema_matches_the_models = on_sqlite.test_migrated_schema_matches_the_models
test_upgrade_from_an_older_revision_keeps_the_data = (
    on_sqlite.test_upgrade_from_an_older_revision_keeps_the_data
)
test_downgrade_with_data_and_back_then_to_base = on_sqlite.test_downgrade_with_data_and_back_then_to_base
test_a_database_from_before_migrations_is_refused_in_one_line = (
    on_sqlite.test_a_database_from_before_migrations_is_refused_in_one_line
)
test_a_database_from_a_newer_canaryd_is_refused = on_sqlite.test_a_database_from_a_newer_canaryd_is_refused
test_db_upgrade_and_current_commands = on_sqlite.test_db_upgrade_and_current_commands
test_migration_gives_old_baselines_and_calibrations_their_configuration = (
    test_configurations.test_migration_gives_old_baselines_and_calibrations_their_configuration
)


def test_postgres_binaries_are_required_not_optional(monkeypatch):
    """Without a server the fixture raises (the tests fail; nothing here ever skips)."""
    monkeypatch.setenv("PG_BINDIR", "/nonexistent")
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr("glob.glob", lambda _pattern: [])
    with pytest.raises(RuntimeError, match="PostgreSQL server binaries not found"):
        PostgresServer()
