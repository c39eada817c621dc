"""The store as a fleet uses it, on SQLite: lossless, deduplicated round trips, two processes writing one
database at once, and detector folds that never lose an update.

tests/e2e/test_postgres.py runs the same tests on a real PostgreSQL (it collects the ones taking ``url``
with its own fixture, and calls `writers`).
"""

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
from canaryd.store import Accepted, Store

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())


@pytest.fixture
def url(tmp_path) -> str:
    return f"sqlite:///{tmp_path}/h.db"


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
        base.observation if base else None,
        o,
        correct=correct,
        baseline_correct=base.correct if base else None,
    )
    return store.add_observation(run, o, comparison, base.observation_id if base else None)


def test_round_trip_is_lossless_deduplicated_and_baselines_work(url):
    store = Store(url, instance="probe-1")
    run = store.start_run("b")
    o = make_obs()
    first = add(store, run, o)
    stored = store.baseline("b", "c")
    assert stored.observation_id == first and stored.correct is True
    base = stored.observation
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
    assert store.run_stacks("b")[0].run_id == run
    (row, loaded), *_ = store.load([drifted])
    line = export_line(row, loaded)
    assert line["instance"] == "probe-1" and line["tokens"][0]["logprob"] == -0.2
    assert json.loads(json.dumps(line))["stack"] == {"vllm.version": "0.33.0"}

    # An error is never a baseline; accept takes the latest success; a changed request re-baselines.
    bad = Observation("b", "c", "s", datetime(2026, 1, 2, tzinfo=UTC), {}, "")
    bad.error, bad.error_kind = "down", ErrorKind.CONNECT
    add(store, store.start_run("b"), bad, correct=None)
    assert store.accept_latest() == [Accepted("b", "c", drifted)]
    assert store.baseline("b", "c").observation_id == drifted
    rebased = add(store, store.start_run("b"), make_obs(request_hash="r2"))
    assert store.baseline("b", "c").observation_id == rebased
    store.keep([first, first, drifted], "pin")
    store.keep([first], "pin")  # idempotent
    assert counts(url, "keep") == {"keep": 2}
    counted = store.prune(datetime(2027, 1, 1, tzinfo=UTC), dry_run=True)
    assert counted["observation"] == 6  # 9, less the baseline and the two kept ones
    store.close()


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
        comparison = compare(base.observation if base else None, o, correct=True)
        store.add_observation(run, o, comparison, base.observation_id if base else None)
    store.finish_run(run, n)
    store.close()
    print("ok", instance)
    """
)


def writers(url: str, tmp_path: Path) -> None:
    """Two processes, each a daemon of the fleet, write one database at the same moment."""
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
    base_id = store.baseline("b", "c").observation_id
    assert next(r for r in rows if r.id == base_id).verdict == "baseline"
    store.close()


def test_two_processes_write_one_database_concurrently(tmp_path):
    writers(f"sqlite:///{tmp_path}/fleet.db", tmp_path)


def test_detector_folds_never_lose_an_update_under_concurrent_schedules(url):
    """Schedules sharing a backend fold its e-CUSUM at once (threads of one daemon, and a second store
    standing for another daemon on the same database): every cycle counts and a raised alarm is never
    cleared. A read-then-write fold fails this on SQLite too (a lost update or a duplicate insert)."""
    stores = [Store(url), Store(url, instance="other")]

    def bump(doc: dict) -> tuple[dict, None]:
        state = DetectorState.from_dict(doc)
        time.sleep(0.001)  # widen the read-modify-write window
        new = DetectorState(state.statistic * 1.01, state.cycles + 1, state.alarm or state.cycles == 7)
        return new.as_dict(), None

    def read(store: Store, backend: str) -> DetectorState:
        return DetectorState.from_dict(store.fold_detector(backend, lambda s: (None, s)))

    with ThreadPoolExecutor(8) as ex:
        list(ex.map(lambda i: stores[i % len(stores)].fold_detector("b", bump), range(80)))
    final = read(stores[0], "b")
    assert final.cycles == 80 and final.alarm
    assert final.statistic == pytest.approx(1.01**80)
    assert read(stores[0], "other") == DetectorState()  # per backend
    for s in stores:
        s.close()
