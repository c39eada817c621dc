"""The store on a real SQLite file: lossless round trips, dedup of stacks and payloads, baselines."""

import dataclasses
import json
import sqlite3
from dataclasses import replace
from datetime import UTC, datetime

from canaryd.judge.compare import compare
from canaryd.judge.evidence import Evidence
from canaryd.judge.stats import DetectorState
from canaryd.observation import Observation, TokenLogprob, canonical_digest
from canaryd.store import Accepted, StackSeen, Store, StoredObservation
from canaryd.store.records import detector_start
from canaryd.store.schema import ObservationRow


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
    stored = store.baseline("b", "c")
    assert stored.observation_id == oid and stored.correct is True
    base = stored.observation
    assert base.tokens == o.tokens and base.stack == o.stack and base.text == "42"
    assert base.tokens[0].logprob == -0.123456789012345  # float64 survives exactly


# A request body and its key in the ``request`` table, as every database written so far holds them: the key
# must never move, or stored observations would no longer find their requests.
BODY = {
    "model": "m",
    "messages": [{"role": "user", "content": "Grüße, 東京?"}],
    "temperature": 0.0,
    "seed": 7,
}
BODY_REF = "39cd664682bf8ba9c2c8d931cc63fbef20b371ca45b78d3ed5b21d58be8a3125"
UNSENT_REF = "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"  # the body ``{}``


def test_a_request_is_stored_under_the_key_its_observation_carries(tmp_path):
    assert canonical_digest(BODY) == BODY_REF and canonical_digest({}) == UNSENT_REF
    made = Observation("b", "c", "s", datetime(2026, 1, 1, tzinfo=UTC), BODY, "r1", text="42")
    assert made.request_ref == BODY_REF  # computed at construction when no prober handed it in
    # a prober that prepared the request hands its key in with an equal body (not the same object)
    prepared = dataclasses.replace(made, request=json.loads(json.dumps(BODY)), request_ref=BODY_REF)
    unsent = Observation("b", "c", "s", datetime(2026, 1, 1, tzinfo=UTC), {}, "", error="not sent: x")
    store = Store(f"sqlite:///{tmp_path}/h.db")
    run = store.start_run("b")
    for o in (made, prepared, unsent):
        store.add_observation(run, o, compare(None, o, correct=True), None)
    db = sqlite3.connect(tmp_path / "h.db")
    assert sorted(db.execute("select hash from request")) == sorted([(BODY_REF,), (UNSENT_REF,)])
    events = "select o.request_ref from event e join outcome o on o.id = e.outcome_id order by e.id"
    assert [r for (r,) in db.execute(events)] == [BODY_REF, BODY_REF, UNSENT_REF]
    assert store.baseline("b", "c").observation.request_ref == BODY_REF  # read back, the same key
    assert store.judging("b").baseline("b", "c").observation.request_ref == BODY_REF


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


def test_a_calibrated_latency_stays_on_its_event_and_the_repeated_outcome_is_stored_once(tmp_path):
    """A latency's evidence differs on every probe: it is written on the event, so that identical answers
    share one outcome row, and each observation reads back with its own."""
    store = Store(f"sqlite:///{tmp_path}/h.db")
    run = store.start_run("b")
    first = make_obs()
    store.add_observation(run, first, compare(None, first, correct=True), None)
    latencies = [0.31, 0.29, 2.5]
    for seconds in latencies:
        o = make_obs()
        o.latency_s = seconds
        ev = Evidence(
            "conformal-nn", statistic=seconds, threshold=1.0, p_value=0.5, detail={"value": seconds}
        )
        store.add_observation(run, o, replace(compare(first, o, correct=True), latency=ev), 1)
    db = sqlite3.connect(tmp_path / "h.db")
    assert db.execute("select count(*) from outcome").fetchone()[0] == 2  # the baseline's and the repeats'
    read = [r.comparison["latency"] for r in store.observations(backend="b")][::-1]  # newest first
    assert read[0] is None
    assert [(lat["statistic"], lat["out"], lat["detail"]) for lat in read[1:]] == [
        (s, s > 1.0, {"value": s}) for s in latencies
    ]
    assert list(store.observations(backend="b")[0].comparison)[-2:] == ["latency", "reference"]  # its place


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
    assert store.accept_latest() == [Accepted("b", "c", newest_id)]
    assert store.baseline("b", "c").observation_id == newest_id


def test_accepting_a_chained_canary_takes_every_step_and_only_its_steps(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/h.db")
    run = store.start_run("b")
    ids = {}
    for cid in ("plan:extract", "plan:answer", "plan_b", "planet:x", "plan"):
        obs = make_obs()
        obs.canary_id = cid
        ids[cid] = store.add_observation(run, obs, compare(None, obs, correct=None), None)
    accepted = store.accept_latest(canary_id="plan")
    assert accepted == [Accepted("b", c, ids[c]) for c in ("plan", "plan:answer", "plan:extract")]
    assert store.accept_latest(canary_id="pl_n") == []  # LIKE wildcards are escaped: not "plan:..."


def test_reads_return_plain_records_with_the_view_s_columns_and_json_forms(tmp_path):
    """The store hands out records, never rows: `StoredObservation` has exactly the view's columns, and
    its JSON form is what ``history --json`` printed when it dumped the row (pydantic: UTC as ``Z``)."""
    view = list(ObservationRow.model_fields)
    assert view[-1] == "latency_evidence"  # the event's, read into the comparison (`queries._stored`)
    assert [f.name for f in dataclasses.fields(StoredObservation)] == view[:-1]
    store = Store(f"sqlite:///{tmp_path}/h.db", instance="i")
    run = store.start_run("b")
    o = make_obs()
    o.started_at = datetime(2026, 1, 1, 3, 4, 5, 123456, tzinfo=UTC)
    oid = store.add_observation(run, o, compare(None, o, correct=True), None)
    (row,) = store.observations()
    assert isinstance(row, StoredObservation) and (row.id, row.run_id, row.instance) == (oid, run, "i")
    as_row = ObservationRow(**dataclasses.asdict(row))
    assert row.as_dict() == as_row.model_dump(mode="json", exclude={"latency_evidence"})
    assert json.dumps(row.as_dict())
    assert row.as_dict()["started_at"] == "2026-01-01T03:04:05.123456Z"
    ((loaded_row, loaded),) = store.load([oid])
    assert loaded_row == row and loaded.tokens == o.tokens
    info = store.run(run)
    assert (info.id, info.backend, info.instance, info.finished_at) == (run, "b", "i", None)
    store.finish_run(run, 1)
    assert store.run(run).canaries == 1 and store.run(run + 1) is None
    (seen,) = store.stacks()
    assert seen == StackSeen("b", row.stack_hash, seen.first_seen, o.stack)
    assert seen.as_dict() == {
        "backend": "b",
        "hash": row.stack_hash,
        "first_seen": seen.first_seen.isoformat(),
        "fields": o.stack,
    }
    (runs,) = store.run_stacks("b")
    assert (runs.run_id, runs.stacks) == (run, (o.stack,))
    store.close()


def test_the_detector_is_stored_as_plain_data_that_round_trips_detector_state(tmp_path):
    assert DetectorState.from_dict(detector_start()) == DetectorState()
    assert DetectorState().as_dict() == detector_start()
    store = Store(f"sqlite:///{tmp_path}/h.db")
    assert store.fold_detector("b", lambda doc: (None, doc)) == detector_start()
    raised = DetectorState(12.5, 3, True, ("c",))
    assert store.fold_detector("b", lambda _: (raised.as_dict(), "result")) == "result"
    assert DetectorState.from_dict(store.fold_detector("b", lambda doc: (None, doc))) == raised
    store.close()
