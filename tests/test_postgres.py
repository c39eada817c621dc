"""The same canaryd on PostgreSQL as on SQLite, and a fleet of writers on one database.

A real PostgreSQL server is started for this module (tests/postgres.py; missing binaries fail the tests,
never skip them). Its TimeZone is deliberately not UTC, so any time that went through the server in local
time would come back shifted. Store tests run on both SQLite and PostgreSQL.
"""

import itertools
import json
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import create_engine

from canaryd.judge.compare import compare
from canaryd.judge.stats import DetectorState
from canaryd.observation import ErrorKind, Observation, TokenLogprob
from canaryd.report.record import export_line
from canaryd.store import SCHEMA_REVISION, Store
from tests.postgres import PostgresServer

REPO = Path(__file__).resolve().parents[1]
_names = itertools.count()


@pytest.fixture(scope="module")
def pg():
    with PostgresServer(timezone="Pacific/Chatham") as server:  # UTC+12:45/+13:45
        yield server


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/h.db"
    return request.getfixturevalue("pg").create_database(f"store{next(_names)}")


def make_obs(lp=-0.123456789012345, stack=None, canary="c", request_hash="r1", t=None):
    o = Observation("b", canary, "s", t or datetime(2026, 1, 1, 12, tzinfo=UTC), {"model": "m"}, request_hash)
    o.text, o.finish_reason, o.system_fingerprint = "42", "stop", "fp"
    o.tokens = [TokenLogprob("4", lp, 52, (52,), (("4", lp), ("5", -3.0))), TokenLogprob("2", -1e-9, 50)]
    o.prompt_tokens, o.completion_tokens = 12, 2
    o.stack = stack or {"vllm.version": "0.32.0", "x": "ü"}
    o.headers = {"x-request-id": "abc"}
    o.latency_s = 0.1 + 1e-12
    return o


def counts(url: str, *tables: str) -> dict[str, int]:
    engine = create_engine(url)
    with engine.connect() as conn:
        out = {t: conn.exec_driver_sql(f"SELECT count(*) FROM {t}").scalar() for t in tables}
    engine.dispose()
    return out


def add(store: Store, run: int, o: Observation, correct=True) -> int:
    base = store.baseline(o.backend, o.canary_id)
    comparison = compare(
        base[1] if base else None, o, correct=correct, baseline_correct=base[2] if base else None
    )
    return store.add_observation(run, o, comparison, base[0] if base else None)


def test_round_trip_is_lossless_deduplicated_and_baselines_work(url):
    store = Store(url, instance="probe-1")
    run = store.start_run("b")
    o = make_obs()
    first = add(store, run, o)
    base_id, base, base_correct = store.baseline("b", "c")
    assert base_id == first and base_correct is True
    assert base.tokens == o.tokens and base.tokens[0].logprob == -0.123456789012345  # float64 exact
    assert base.stack == o.stack and base.headers == o.headers and base.request == o.request
    assert base.started_at == o.started_at and base.started_at.utcoffset() == timedelta(0)
    assert base.latency_s == o.latency_s
    store.finish_run(run, 1)
    for _ in range(5):  # a pass is a run: one observation of a plain canary each
        add(store, store.start_run("b"), make_obs())
    run = store.start_run("b")
    drifted = add(store, run, make_obs(lp=-0.2, stack={"vllm.version": "0.33.0"}))
    store.finish_run(run, 1)
    assert counts(url, "observation", "event", "outcome", "payload", "stack", "request") == {
        "observation": 7,
        "event": 7,
        "outcome": 3,  # baseline, identical, logprob-drift
        "payload": 2,
        "stack": 2,
        "request": 1,
    }
    rows = store.observations()
    assert [r.verdict for r in rows][:2] == ["logprob-drift", "identical"]
    assert {r.instance for r in rows} == {"probe-1"}
    assert len(store.stacks("b")) == 2 and store.canaries("b") == ["c"]
    assert [v for _, v in store.verdicts("b", "c")][:2] == ["logprob-drift", "identical"]
    assert store.run_stacks("b")[0][0] == run
    (row, loaded), *_ = store.load([drifted])
    line = export_line(row, loaded)
    assert line["instance"] == "probe-1" and line["tokens"][0]["logprob"] == -0.2
    assert json.loads(json.dumps(line))["stack"] == {"vllm.version": "0.33.0"}

    # An error is never a baseline; accept takes the latest success; a changed request re-baselines.
    bad = Observation("b", "c", "s", datetime(2026, 1, 2, tzinfo=UTC), {}, "")
    bad.error, bad.error_kind = "down", ErrorKind.CONNECT
    add(store, store.start_run("b"), bad, correct=None)
    assert store.accept_latest() == [("b", "c", drifted)]
    assert store.baseline("b", "c")[0] == drifted
    rebased = add(store, store.start_run("b"), make_obs(request_hash="r2"))
    assert store.baseline("b", "c")[0] == rebased
    store.keep([first, first, drifted], "pin")
    store.keep([first], "pin")  # idempotent
    assert counts(url, "keep") == {"keep": 2}
    counted = store.prune(datetime(2027, 1, 1, tzinfo=UTC), dry_run=True)
    assert counted["observation"] == 6  # 9, less the baseline and the two kept ones
    store.close()


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
    assert [(r["id"], r["instance"]) for r in json.loads(history.stdout)] == [(i, "eu-1") for i in ids[::-1]]
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


WRITER = textwrap.dedent(
    """
    import sys, time
    from datetime import UTC, datetime
    from pathlib import Path
    from canaryd.judge.compare import compare
    from canaryd.observation import Observation, TokenLogprob
    from canaryd.store import Store

    url, instance, go, n = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
    while not go.exists():
        time.sleep(0.002)
    store = Store(url, instance=instance)  # both migrate a fresh database at the same moment
    run = store.start_run("b")
    for i in range(n):
        o = Observation("b", "c", "s", datetime(2026, 1, 1, tzinfo=UTC), {"model": "m"}, "r1")
        lp = -(i + 1) / 7  # new content every step, the same in both processes: they race to insert it
        o.text, o.tokens = "42", [TokenLogprob("4", lp, 52, (52,), (("4", lp), ("5", -3.0)))]
        o.stack = {"vllm.version": "0.32.0"}
        base = store.baseline("b", "c")
        comparison = compare(base[1] if base else None, o, correct=True)
        store.add_observation(run, o, comparison, base[0] if base else None)
    store.finish_run(run, n)
    store.close()
    print("ok", instance)
    """
)


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_two_processes_write_one_database_concurrently(backend, pg, tmp_path):
    url = pg.create_database("fleet") if backend == "postgresql" else f"sqlite:///{tmp_path}/fleet.db"
    n, go = 150, tmp_path / "go"
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), url, name, str(go), str(n)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("probe-a", "probe-b")
    ]
    time.sleep(1.5)  # both interpreters up and waiting
    go.touch()
    results = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, results, strict=True):
        assert p.returncode == 0 and err == "", err
        assert out.splitlines()[-1].startswith("ok")
    c = counts(url, "event", "payload", "stack", "request", "outcome", "baseline", "run", "alembic_version")
    assert c["event"] == 2 * n and c["run"] == 2 and c["alembic_version"] == 1
    assert (c["payload"], c["stack"], c["request"], c["baseline"]) == (n, 1, 1, 1)
    assert n <= c["outcome"] <= n + 2  # identical outcomes shared (the first step may be judged twice)
    store = Store(url, instance="reader")
    rows = store.observations(limit=10 * n)
    assert {r.instance for r in rows} == {"probe-a", "probe-b"}
    assert len(store.observations(instance="probe-a", limit=10 * n)) == n
    assert sum(r.verdict == "baseline" for r in rows) <= 2
    base_id = store.baseline("b", "c")[0]
    assert next(r for r in rows if r.id == base_id).verdict == "baseline"
    store.close()


def test_detector_folds_never_lose_an_update_under_concurrent_schedules(url, pg):
    """Schedules sharing a backend fold its e-CUSUM at once (threads of one daemon, and a second store
    standing for another daemon on the same database): every cycle counts and a raised alarm is never
    cleared. A read-then-write fold fails this on SQLite too (a lost update or a duplicate insert)."""
    stores = [Store(url), Store(url, instance="other")]

    def bump(state: DetectorState) -> tuple[DetectorState, None]:
        time.sleep(0.001)  # widen the read-modify-write window
        return DetectorState(state.statistic * 1.01, state.cycles + 1, state.alarm or state.cycles == 7), None

    with ThreadPoolExecutor(8) as ex:
        list(ex.map(lambda i: stores[i % len(stores)].fold_detector("b", bump), range(80)))
    final = stores[0].fold_detector("b", lambda s: (None, s))
    assert final.cycles == 80 and final.alarm
    assert final.statistic == pytest.approx(1.01**80)
    assert stores[0].fold_detector("other", lambda s: (None, s)) == DetectorState()  # per backend
    for s in stores:
        s.close()
