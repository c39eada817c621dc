"""Alembic migrations on SQLite: from empty, from an older revision, the refusals, ``canaryd db
upgrade``/``db current``, and the equivalent of ``alembic check`` (the models and the migrated schema agree,
so a model change without a migration fails here).

The tests taking ``url`` run on a real PostgreSQL too: tests/e2e/test_migrations.py collects them with its
own ``url`` fixture."""

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Column, MetaData, String, create_engine, inspect
from sqlmodel import SQLModel

from canaryd.store import Store
from canaryd.store.engine import (
    AUTOGENERATE_OPTIONS,
    SCHEMA_REVISION,
    SchemaMismatch,
    alembic_config,
    current_revision,
    make_engine,
    migrate,
)
from canaryd.store.schema import ObservationRow


@pytest.fixture
def url(tmp_path) -> str:
    """The database the shared tests migrate: a SQLite file (tests/e2e/test_migrations.py: PostgreSQL)."""
    return f"sqlite:///{tmp_path}/state/canaryd.db"


def schema_diff(url: str, metadata: MetaData = SQLModel.metadata) -> list:
    """What `alembic check` would find: differences between the migrated database and the models."""
    engine = make_engine(url)
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts=AUTOGENERATE_OPTIONS)
        diff = compare_metadata(ctx, metadata)
    engine.dispose()
    return diff


def upgrade_to(url: str, revision: str) -> None:
    engine = make_engine(url)
    with engine.begin() as conn:
        command.upgrade(alembic_config(conn), revision)
    engine.dispose()


def test_one_head_and_store_knows_it():
    script = ScriptDirectory.from_config(alembic_config())
    assert script.get_heads() == [SCHEMA_REVISION], "bump store.engine.SCHEMA_REVISION to the new head"
    assert [r.revision for r in script.walk_revisions()][-1] == "0001"


def test_migrated_schema_matches_the_models(url):
    Store(url).close()
    assert schema_diff(url) == []
    # The view is outside autogenerate: its columns must be the model's.
    engine = create_engine(url)
    view = [c["name"] for c in inspect(engine).get_columns("observation")]
    engine.dispose()
    assert view == list(ObservationRow.model_fields)
    # And the check is not vacuous: a model change without a migration is found.
    changed = MetaData()
    for table in SQLModel.metadata.tables.values():
        table.to_metadata(changed)
    changed.tables["run"].append_column(Column("region", String(), nullable=True))
    assert [d[0] for d in schema_diff(url, changed)] == ["add_column"]


def test_upgrade_from_an_older_revision_keeps_the_data(url):
    upgrade_to(url, "0001")
    engine = create_engine(url)
    with engine.begin() as conn:  # rows as the 0001 schema has them (no run.instance)
        for sql in (
            "INSERT INTO run (backend, started_at, canaries) VALUES ('b', '2026-01-01 00:00:00', 1)",
            "INSERT INTO request (hash, body) VALUES ('q', '{\"model\": \"m\"}')",
            "INSERT INTO outcome (hash, backend, canary_id, suite, request_ref, request_hash, text, "
            "verdict, comparison) VALUES ('h', 'b', 'c', 's', 'q', 'r1', '42', 'baseline', '{}')",
            "INSERT INTO event (run_id, outcome_id, started_at, latency_s, headers) "
            "SELECT run.id, outcome.id, '2026-01-01 00:00:00', 0.5, '{}' FROM run, outcome",
        ):
            conn.exec_driver_sql(sql)
    engine.dispose()
    store = Store(url, instance="new")  # what the daemon does before READY=1
    assert current_revision(store.engine) == SCHEMA_REVISION
    run = store.start_run("b")
    (old,) = store.observations()
    assert (old.run_id, old.text, old.instance, old.request) == (run - 1, "42", "", {"model": "m"})
    assert store.observation(old.id).latency_s == 0.5
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql(f"SELECT instance FROM run WHERE id = {run}").scalar() == "new"
    store.close()
    assert schema_diff(url) == []


def test_latency_evidence_written_before_0009_reads_back_from_its_outcome(url):
    upgrade_to(url, "0008")
    engine = create_engine(url)
    before = '{"verdict": "identical", "latency": {"statistic": 0.2, "out": false}, "reference": null}'
    with engine.begin() as conn:
        for sql in (
            "INSERT INTO run (backend, instance, started_at, canaries) "
            "VALUES ('b', 'i', '2026-01-01 00:00:00', 1)",
            "INSERT INTO request (hash, body) VALUES ('q', '{}')",
            "INSERT INTO outcome (hash, backend, canary_id, suite, request_ref, request_hash, verdict, "
            f"comparison) VALUES ('h', 'b', 'c', 's', 'q', 'r1', 'identical', '{before}')",
            "INSERT INTO event (run_id, outcome_id, started_at, latency_s, headers) "
            "SELECT run.id, outcome.id, '2026-01-01 00:00:00', 0.5, '{}' FROM run, outcome",
        ):
            conn.exec_driver_sql(sql)
    engine.dispose()
    store = Store(url)
    (old,) = store.observations()
    assert old.comparison["latency"] == {"statistic": 0.2, "out": False}
    store.close()
    assert schema_diff(url) == []


def test_downgrade_with_data_and_back_then_to_base(url):
    store = Store(url, instance="x")
    store.start_run("b")
    store.close()
    engine = make_engine(url)
    with engine.begin() as conn:
        command.downgrade(alembic_config(conn), "0001")
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM run").scalar() == 1
    assert migrate(engine) == ("0001", SCHEMA_REVISION)
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT instance FROM run").scalar() == ""  # the name did not survive
    with engine.begin() as conn:
        command.downgrade(alembic_config(conn), "base")
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    assert current_revision(engine) is None
    assert migrate(engine) == (None, SCHEMA_REVISION)
    engine.dispose()
    assert schema_diff(url) == []


def test_a_database_from_before_migrations_is_refused_in_one_line(url):
    engine = make_engine(url)
    tables = [t for t in SQLModel.metadata.sorted_tables if t.name != "observation"]
    SQLModel.metadata.create_all(engine, tables=tables)  # the old create_all way: no alembic_version
    engine.dispose()
    with pytest.raises(SchemaMismatch, match="older canaryd, from before schema migrations") as e:
        Store(url)
    assert "\n" not in str(e.value)


def test_a_database_from_a_newer_canaryd_is_refused(url):
    Store(url).close()
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE alembic_version SET version_num = '9999'")
    engine.dispose()
    with pytest.raises(SchemaMismatch, match="revision 9999 is newer than this canaryd"):
        Store(url)


def test_db_upgrade_and_current_commands(url, tmp_path):
    (tmp_path / "suite.toml").write_text('[suite]\nname = "t"\n[[canary]]\nid = "c"\nprompt = "x"\n')
    cfg = tmp_path / "canaryd.toml"
    cfg.write_text(
        "state_dir = 'state'\nsuites = ['suite.toml']\n[[backends]]\nname = 'b'\nkind = 'openai'\n"
        f"base_url = 'http://127.0.0.1:9/v1'\nmodel = 'm'\n[storage]\nurl = '{url}'\n"
    )

    def canaryd(*args: str) -> subprocess.CompletedProcess:
        p = subprocess.run(
            [sys.executable, "-m", "canaryd", "-c", str(cfg), "db", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert "Traceback" not in p.stderr and p.stderr == "", p.stderr
        return p

    if url.startswith("sqlite:///"):  # no file yet: `db current` reads, so it creates nothing and says so
        db = Path(url.removeprefix("sqlite:///"))
        missing = subprocess.run(
            [sys.executable, "-m", "canaryd", "-c", str(cfg), "db", "current"], capture_output=True, text=True
        )
        assert missing.returncode == 2 and "no history database" in missing.stderr and not db.parent.exists()
        db.parent.mkdir()
        sqlite3.connect(db).close()  # an empty file: an empty database
    empty = canaryd("current", "--check")
    assert empty.returncode == 1 and empty.stdout.startswith("none: an empty database")
    up = canaryd("upgrade")
    assert up.returncode == 0 and f"created the schema at revision {SCHEMA_REVISION} (head)" in up.stdout
    assert canaryd("upgrade").stdout.endswith("nothing to do\n")
    current = canaryd("current", "--check")
    assert current.returncode == 0 and current.stdout == f"{SCHEMA_REVISION} (head)\n"

    engine = make_engine(url)
    with engine.begin() as conn:
        command.downgrade(alembic_config(conn), "0001")
    engine.dispose()
    behind = canaryd("current", "--check")
    assert behind.returncode == 1 and behind.stdout.startswith("0001 (head is")
    up = canaryd("upgrade")
    assert up.returncode == 0 and f"upgraded from revision 0001 to {SCHEMA_REVISION}" in up.stdout


def test_a_new_sqlite_file_appears_whole_with_its_schema(tmp_path):
    db = tmp_path / "state" / "canaryd.db"
    engine = make_engine(f"sqlite:///{db}")
    assert current_revision(engine) is None and not db.exists()  # looking creates nothing
    assert migrate(engine) == (None, SCHEMA_REVISION)
    engine.dispose()
    assert [p.name for p in db.parent.iterdir()] == ["canaryd.db"]  # built aside, linked in, no leftovers
    con = sqlite3.connect(db)
    names = {r[0] for r in con.execute("SELECT name FROM sqlite_master")}
    assert {"alembic_version", "run", "event", "observation"} <= names
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_pre_migration_sqlite_file_is_a_one_line_storage_error_from_the_cli(tmp_path):
    db = tmp_path / "state" / "canaryd.db"
    db.parent.mkdir()
    sqlite3.connect(db).execute("create table run (id integer primary key)")
    (tmp_path / "suite.toml").write_text('[suite]\nname = "t"\n[[canary]]\nid = "c"\nprompt = "x"\n')
    cfg = tmp_path / "canaryd.toml"
    cfg.write_text(
        "state_dir = 'state'\nsuites = ['suite.toml']\n[[backends]]\nname = 'b'\nkind = 'openai'\n"
        "base_url = 'http://127.0.0.1:9/v1'\nmodel = 'm'\n"
    )
    for args in (["history"], ["db", "upgrade"], ["db", "current"]):
        p = subprocess.run(
            [sys.executable, "-m", "canaryd", "-c", str(cfg), *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == 4 and p.stderr.count("\n") == 1, p.stderr
        assert "older canaryd" in p.stderr and "move the database aside" in p.stderr


def test_alembic_needs_no_ini_file_at_run_time():
    cfg = alembic_config()
    assert cfg.config_file_name is None
    assert Path(cfg.get_main_option("script_location"), "env.py").is_file()
