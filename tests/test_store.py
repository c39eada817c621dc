"""The store on a real SQLite file: lossless round trips, dedup of stacks and payloads, baselines."""

import sqlite3
from datetime import UTC, datetime

from canaryd.judge.compare import compare
from canaryd.observation import Observation, TokenLogprob
from canaryd.store import Store


def make_obs(lp=-0.123456789012345, stack=None):
    o = Observation("b", "c", "s", datetime(2026, 1, 1, tzinfo=UTC), {"model": "m"}, "r1")
    o.text, o.finish_reason, o.system_fingerprint = "42", "stop", "fp"
    o.tokens = [TokenLogprob("4", lp, 52, (52,), (("4", lp), ("5", -3.0))), TokenLogprob("2", -1e-9, 50)]
    o.prompt_tokens, o.completion_tokens = 12, 2
    o.stack = stack or {"vllm.version": "0.32.0"}
    return o


def test_round_trip_is_lossless_and_first_observation_becomes_baseline(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/h.db")
    run = store.start_run("b")
    o = make_obs()
    oid = store.add_observation(run, o, compare(None, o, correct=True), None)
    base_id, base, base_correct = store.baseline("b", "c")
    assert base_id == oid and base_correct is True
    assert base.tokens == o.tokens and base.stack == o.stack and base.text == "42"
    assert base.tokens[0].logprob == -0.123456789012345  # float64 survives exactly


def test_unchanged_payloads_and_stacks_are_stored_once(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/h.db")
    run = store.start_run("b")
    first = make_obs()
    store.add_observation(run, first, compare(None, first, correct=True), None)
    for _ in range(5):
        o = make_obs()
        store.add_observation(run, o, compare(first, o, correct=True), 1)
    changed = make_obs(lp=-0.2, stack={"vllm.version": "0.33.0"})
    store.add_observation(run, changed, compare(first, changed, correct=True), 1)
    db = sqlite3.connect(tmp_path / "h.db")
    counts = {
        t: db.execute(f"select count(*) from {t}").fetchone()[0] for t in ("observation", "payload", "stack")
    }
    assert counts == {"observation": 7, "payload": 2, "stack": 2}
    assert db.execute("pragma integrity_check").fetchone()[0] == "ok"
    assert db.execute("pragma journal_mode").fetchone()[0] == "wal"
    assert [r.verdict for r in store.observations()][:2] == ["logprob-drift", "identical"]
    assert len(store.stacks("b")) == 2


def test_errors_never_become_baselines_and_accept_takes_latest_success(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/h.db")
    run = store.start_run("b")
    bad = Observation("b", "c", "s", datetime(2026, 1, 1, tzinfo=UTC), {}, "")
    bad.error = "down"
    from canaryd.observation import ErrorKind

    bad.error_kind = ErrorKind.CONNECT
    store.add_observation(run, bad, compare(None, bad, correct=None), None)
    assert store.baseline("b", "c") is None
    good = make_obs()
    store.add_observation(run, good, compare(None, good, correct=True), None)
    newer = make_obs(lp=-0.5)
    newest_id = store.add_observation(run, newer, compare(good, newer, correct=True), 2)
    store.add_observation(run, bad, compare(None, bad, correct=None), None)
    assert store.accept_latest() == [("b", "c", newest_id)]
    assert store.baseline("b", "c")[0] == newest_id


def test_accepting_a_chained_canary_takes_every_step_and_only_its_steps(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/h.db")
    run = store.start_run("b")
    ids = {}
    for cid in ("plan:extract", "plan:answer", "plan_b", "planet:x", "plan"):
        obs = make_obs()
        obs.canary_id = cid
        ids[cid] = store.add_observation(run, obs, compare(None, obs, correct=None), None)
    accepted = store.accept_latest(canary_id="plan")
    assert sorted(accepted) == [("b", c, ids[c]) for c in ("plan", "plan:answer", "plan:extract")]
    assert store.accept_latest(canary_id="pl_n") == []  # LIKE wildcards are escaped: not "plan:..."
