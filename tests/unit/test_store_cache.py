"""What a probe pass reads, held between passes (`canaryd.store.cache`), and its one write transaction.

The tests taking ``url`` run on SQLite here and on a real PostgreSQL in tests/e2e/test_store_cache_pg.py:
two `Store` objects on one database stand for two processes (a daemon and ``canaryd baseline accept``, or
two daemons of a fleet).
"""

from __future__ import annotations

import inspect
import re
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import event

from canaryd.judge.compare import compare
from canaryd.judge.stats import fit
from canaryd.observation import Observation
from canaryd.store import Reads, Store
from tests.harness.scripted_lab import ScriptedLab, by_id, change, scripted, verdicts
from tests.unit.test_store_fleet import counts, make_obs

# A statement reading baseline or calibration rows (the generation statement reads only aggregates).
ROW_READ = re.compile(r"FROM (baseline|calibration|observation)\b(?! *\))", re.I)


@pytest.fixture
def url(tmp_path) -> str:
    return f"sqlite:///{tmp_path}/h.db"


@contextmanager
def statements(store: Store):
    """Every SQL statement ``store`` sends meanwhile."""
    seen: list[str] = []

    def record(_conn, _cursor, sql, *_):
        seen.append(sql)

    event.listen(store.engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(store.engine, "before_cursor_execute", record)


def judged_pass(store: Store, *observations: Observation) -> list[int | Exception]:
    """One pass as `probe_backend` makes it: the backend's reads, each observation judged, one write."""
    run = store.start_run("b")
    reads = store.judging("b")
    items = []
    for o in observations:
        base = reads.baseline(o.backend, o.canary_id)
        c = compare(base.observation if base else None, o, correct=True, baseline_correct=True)
        items.append((o, c, base.observation_id if base else None))
    return store.record(run, items, len(observations))


def test_an_unchanged_pass_reads_no_baseline_or_calibration_row(url):
    store = Store(url)
    [first] = judged_pass(store, make_obs())
    with statements(store) as sql:
        reads = store.judging("b")  # the generation moved (the pass above set a baseline): re-read
    assert any(ROW_READ.search(s) for s in sql)
    assert reads.baseline("b", "c").observation_id == first
    for _ in range(3):
        with statements(store) as sql:
            reads = store.judging("b")
        assert len(sql) == 1 and not ROW_READ.search(sql[0])  # the generation statement alone
        assert reads.baseline("b", "c").observation_id == first and reads.calibration("b", "c") is None
    store.close()


def test_a_baseline_accepted_through_another_store_is_used_by_the_next_pass(url):
    daemon, cli = Store(url), Store(url, instance="cli")
    [first] = judged_pass(daemon, make_obs())
    [moved] = judged_pass(daemon, make_obs(lp=-0.5))
    assert daemon.judging("b").baseline("b", "c").observation_id == first
    assert cli.accept_latest("b") and cli.baseline("b", "c").observation_id == moved
    reads = daemon.judging("b")
    assert reads.baseline("b", "c").observation_id == moved
    assert reads.baseline("b", "c").observation.tokens[0].logprob == -0.5
    for s in (daemon, cli):
        s.close()


def test_a_calibration_saved_or_dropped_through_another_store_is_used_by_the_next_pass(url):
    daemon, cli = Store(url), Store(url, instance="cli")
    judged_pass(daemon, make_obs())
    assert daemon.judging("b").calibration("b", "c") is None
    base = daemon.baseline("b", "c").observation
    model = fit([base, base])
    cli.save_calibration("b", "c", model)
    assert daemon.judging("b").calibration("b", "c") == model.as_dict()
    cli.save_calibration("b", "c", fit([base, make_obs(lp=-0.2)]))  # replaced: same count of rows
    assert daemon.judging("b").calibration("b", "c") == cli.calibration("b", "c") != model.as_dict()
    assert cli.drop_calibrations([("b", "c")]) == 1
    assert daemon.judging("b").calibration("b", "c") is None
    for s in (daemon, cli):
        s.close()


def test_a_prune_through_another_store_loses_and_corrupts_nothing_of_the_next_pass(url):
    daemon, cli = Store(url), Store(url, instance="cli")
    judged_pass(daemon, make_obs())
    judged_pass(daemon, make_obs(lp=-0.5))  # a payload that only this observation uses: known to `daemon`
    pruned = cli.prune(datetime.now(UTC) + timedelta(days=1))
    assert pruned["payload"] == 1 and pruned["observation"] == 1
    [again] = judged_pass(daemon, make_obs(lp=-0.5, t=datetime.now(UTC)))  # refers to the pruned payload
    assert isinstance(again, int)
    [(_, obs)] = daemon.load([again])
    assert obs.tokens == make_obs(lp=-0.5).tokens and obs.stack == make_obs().stack
    assert counts(url, "event", "payload")["payload"] == 2
    for s in (daemon, cli):
        s.close()


def test_a_pass_writes_in_one_transaction_and_a_refused_observation_costs_only_itself(url):
    store = Store(url)
    commits: list[int] = []
    event.listen(store.engine, "commit", lambda _conn: commits.append(1))
    good = [make_obs(canary=f"c{i}", lp=-0.1 * i) for i in range(4)]
    written = judged_pass(store, *good)
    assert len(commits) == 2 and all(isinstance(i, int) for i in written)  # the run, then the pass
    bad = make_obs(canary="c9")
    bad.prompt_tokens = 2**64  # no database column holds it
    commits.clear()
    written = judged_pass(store, good[0], bad, good[1])
    assert isinstance(written[1], Exception)
    ids = [written[0], written[2]]
    assert all(isinstance(i, int) for i in ids)
    loaded = store.load(ids)  # the others whole: nothing half-written, nothing lost
    assert [o.canary_id for _, o in loaded] == ["c0", "c1"]
    assert [o.tokens for _, o in loaded] == [good[0].tokens, good[1].tokens]
    assert counts(url, "event")["event"] == 6
    assert store.run(store.observations(limit=1)[0].run_id).canaries == 3  # the run finished all the same
    store.close()


# -- the same through probe passes of the scripted kind ---------------------------------------------------


@pytest.fixture
def lab(tmp_path):
    lab = ScriptedLab(tmp_path, scripted("fake", body=change(at=3, text="43", canaries=["add"])))
    yield lab
    lab.close()


def test_unchanged_passes_judge_from_memory_and_an_accept_elsewhere_takes_effect_next_pass(lab):
    assert set(verdicts(lab.cycle()).values()) == {"baseline"}
    assert set(verdicts(lab.cycle()).values()) == {"identical"}  # re-read: the first pass set baselines
    with statements(lab.store) as sql:
        run = lab.cycle()  # "add" answers 43 from now on
    assert verdicts(run)["add"] not in ("identical", "baseline")
    assert [s for s in sql if ROW_READ.search(s)] == []
    other = Store(lab.config.storage_url, instance="cli")
    accepted = other.accept_latest("fake", "add")  # as `baseline accept` does: the old noise model goes too
    other.drop_calibrations([(a.backend, a.canary_id, a.configuration) for a in accepted])
    with statements(lab.store) as sql:
        run = lab.cycle()
    assert verdicts(run)["add"] == "identical"  # against the baseline the other store accepted
    assert by_id(run)["add"].comparison.verdict.value == "identical"
    assert any(ROW_READ.search(s) for s in sql)
    other.close()


def test_a_calibration_by_another_process_is_used_by_the_next_pass(lab):
    lab.cycle()
    p = lab.cli("baseline", "calibrate", "--backend", "fake")
    assert p.returncode == 0, p.stderr
    run = lab.cycle()
    assert by_id(run)["capital"].comparison.evidence is not None  # judged with the calibrated noise


def test_every_reader_a_pass_judges_through_is_the_named_read_interface():
    """The database's reads, the pass's memory of them and the pooled view of a replaced configuration
    answer the same `Reads`: each method, with the same parameters."""
    from canaryd.probe.run import _Pooled
    from canaryd.store.cache import Judging
    from canaryd.store.queries import Queries

    names = sorted(n for n in vars(Reads) if not n.startswith("_"))
    assert names == ["baseline", "baselines", "calibration", "configurations", "run_set"]
    for reader in (Queries, Judging, _Pooled):
        for name in names:
            wanted = inspect.signature(getattr(Reads, name)).parameters
            assert inspect.signature(getattr(reader, name)).parameters.keys() == wanted.keys(), (reader, name)
