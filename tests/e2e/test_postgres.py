"""The same canaryd on PostgreSQL as on SQLite, and a fleet of writers on one database.

A real PostgreSQL server is started for this module (tests/harness/postgres.py; missing binaries fail the
tests, never skip them). Its TimeZone is deliberately not UTC, so any time that went through the server in
local time would come back shifted. The store tests are those of tests/unit/test_store_fleet.py (on SQLite
there), collected here with a PostgreSQL ``url``.
"""

import itertools
import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pytest

from canaryd.store import Store
from canaryd.store.engine import SCHEMA_REVISION
from tests.harness.postgres import PostgresServer
from tests.unit import test_store_fleet as on_sqlite
from tests.unit.test_store_fleet import add, make_obs, writers

_names = itertools.count()


@pytest.fixture(scope="module")
def pg():
    with PostgresServer(timezone="Pacific/Chatham") as server:  # UTC+12:45/+13:45
        yield server


@pytest.fixture
def url(pg) -> str:
    return pg.create_database(f"store{next(_names)}")


# The SQLite tests, collected again: pytest gives them this module's ``url``, a PostgreSQL database.
test_round_trip_is_lossless_deduplicated_and_baselines_work = (
    on_sqlite.test_round_trip_is_lossless_deduplicated_and_baselines_work
)
test_detector_folds_never_lose_an_update_under_concurrent_schedules = (
    on_sqlite.test_detector_folds_never_lose_an_update_under_concurrent_schedules
)


def test_cli_on_postgres_history_export_accept_and_prune(pg, tmp_path):
    url = pg.create_database("cli")
    store = Store(url, instance="eu-1")
    runs = [store.start_run("b") for _ in range(3)]  # a pass each: one observation of the canary per run
    ids = [
        add(store, r, make_obs(t=datetime.now(UTC) - timedelta(days=d)))
        for r, d in zip(runs, (40, 39, 1), strict=True)
    ]
    store.close()
    cfg = tmp_path / "canaryd.toml"
    (tmp_path / "suite.toml").write_text('[suite]\nname = "t"\n[[canary]]\nid = "c"\nprompt = "x"\n')
    cfg.write_text(
        "state_dir = 'state'\nsuites = ['suite.toml']\n[[backends]]\nname = 'b'\nkind = 'openai'\n"
        f"base_url = 'http://127.0.0.1:9/v1'\nmodel = 'm'\n[storage]\nurl = '{pg.url('cli')}'\n"
    )

    def canaryd(*args: str) -> subprocess.CompletedProcess:
        p = subprocess.run(
            [sys.executable, "-m", "canaryd", "-c", str(cfg), *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert "Traceback" not in p.stderr, p.stderr
        return p

    history = canaryd("history", "--json")
    assert history.returncode == 0, history.stderr
    observations = json.loads(history.stdout)["observations"]
    assert [(r["id"], r["instance"]) for r in observations] == [(i, "eu-1") for i in ids[::-1]]
    export = canaryd("export", "--run", str(runs[1]))
    assert [
        (json.loads(line)["id"], json.loads(line)["instance"]) for line in export.stdout.splitlines()
    ] == [(ids[1], "eu-1")]
    accept = canaryd("baseline", "accept")
    assert accept.returncode == 0 and f"baseline is now observation {ids[2]}" in accept.stdout
    prune = canaryd("prune", "--older-than", "30d")  # the 39-day-old one (the 40-day one judged the rest)
    assert prune.returncode == 0 and "deleted 1 observations" in prune.stdout, prune.stdout
    current = canaryd("db", "current")
    assert current.returncode == 0 and current.stdout == f"{SCHEMA_REVISION} (head)\n"
    assert not (tmp_path / "state" / "canaryd.db").exists()  # nothing went to SQLite


def test_two_processes_write_one_database_concurrently(pg, tmp_path):
    writers(pg.create_database("fleet"), tmp_path)
