"""Serving configurations: a backend answered by several configurations (a load balancer over servers
with other dtypes, a router over providers) keeps a baseline and a calibration per configuration.

Driven through the scripted kind's ``fleet`` (the real registry, config, store and judge), the migration
of old rows on SQLite (tests/e2e/test_migrations.py runs it on PostgreSQL), the gates and metrics, and a
simulation with known answers: the detector's false-alarm rate holds per configuration, and does not under
one baseline per canary × backend.
"""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime

import pytest
from sqlalchemy import create_engine

from canaryd.daemon.metrics import Metrics
from canaryd.judge.compare import Verdict, compare, decide
from canaryd.judge.stats import DetectorState, fit
from canaryd.observation import Observation, TokenLogprob
from canaryd.report.configurations import over_limit, served
from canaryd.report.pin import Pin, PinnedBackend, check_pin
from canaryd.stack import IDENTITY_FIELDS, configuration_of
from canaryd.store import Store
from canaryd.store.engine import SCHEMA_REVISION, current_revision
from tests.harness.scripted_lab import change, scripted, verdicts
from tests.unit.test_migrations import upgrade_to

IDS = ["add", "capital", "colors"]
FLEET = """
[[backends.fleet]]
name = "fp32"
fingerprint = "vllm-0.32-aaaa1111"
[[backends.fleet]]
name = "bf16"
fingerprint = "vllm-0.32-bbbb2222"
logprob_shift = -0.03
"""
THIRD = """
[[backends.fleet]]
name = "third"
fingerprint = "third"
logprob_shift = -0.07
"""


def fleet(body: str = "", **settings) -> str:
    return scripted(concurrency=1, body=FLEET + body, **{"seed": 0, **settings})  # the picks, pinned


def configurations_of_run(run) -> dict[str, str]:
    return {r.observation.canary_id: configuration_of(r.observation.stack) for r in run.results}


# -- the identity ----------------------------------------------------------------------------------------


def test_configuration_is_a_stable_id_of_the_identity_fields_only():
    a = {"response.system_fingerprint": "vllm-0.32-aaaa1111", "vllm.version": "0.32", "request.model": "m"}
    same = {**a, "vllm.version": "0.33", "header.x-request-id": "r2"}  # snapshot and per-request fields
    assert configuration_of(a) == configuration_of(same) and len(configuration_of(a)) == 12
    assert configuration_of({**a, "response.system_fingerprint": "vllm-0.32-cccc3333"}) != configuration_of(a)
    assert configuration_of({**a, "response.provider": "DeepInfra"}) != configuration_of(a)
    for absent in ("", "None"):  # how a missing fingerprint reaches a flat map
        assert configuration_of({"response.system_fingerprint": absent, "response.model": "m"}) == ""
    assert configuration_of({}) == ""
    assert "response.model" not in IDENTITY_FIELDS  # a model name change is drift, never a configuration


# -- a fleet through the scripted kind ------------------------------------------------------------------


def test_a_random_two_configuration_fleet_gives_no_drift_and_reports_two_configurations(make):
    lab = make(fleet())
    runs = [lab.cycle() for _ in range(12)]
    assert verdicts(runs[0]) == dict.fromkeys(IDS, "baseline")
    seen = [v for run in runs for v in verdicts(run).values()]
    assert not [v for v in seen if Verdict(v).is_drift], seen
    # each canary's second configuration is new to it exactly once, then identical against its own baseline
    assert seen.count("new-configuration") == len(IDS)
    assert set(seen) == {"baseline", "new-configuration", "identical"}
    configurations = {c for run in runs for c in configurations_of_run(run).values()}
    assert len(configurations) == 2
    assert max(s.count for run in runs for s in served(run.results).values()) == 2
    assert set(lab.store.baselines("fake", "add")) == configurations
    new = next(r for run in runs for r in run.results if r.comparison.verdict is Verdict.NEW_CONFIG)
    other = (configurations - {configuration_of(new.observation.stack)}).pop()
    # the newcomer compared with the other configuration: the bf16 offset shows
    assert new.comparison.reasons[1].startswith(f"against configuration {other} it would be logprob-drift")


def test_the_same_fleet_under_one_baseline_per_backend_would_drift(make):
    """The contrast: without configurations (answers naming none), the other server's answers drift."""
    one = fleet().replace('"vllm-0.32-aaaa1111"', '""').replace('"vllm-0.32-bbbb2222"', '""')
    lab = make(one, tail="[compare]\nlearn = false\n")  # learning would hold the mix as noise
    runs = [lab.cycle() for _ in range(8)]
    assert {c for run in runs for c in configurations_of_run(run).values()} == {""}
    drifted = [v for run in runs[1:] for v in verdicts(run).values() if Verdict(v).is_drift]
    assert drifted and set(drifted) == {"logprob-drift"}


def test_a_change_inside_one_configuration_is_drift_of_that_configuration_only(make):
    lab = make(fleet(change(at=6, member="bf16", logprob_shift=-0.2)))
    for _ in range(5):
        lab.cycle()
    later = [lab.cycle() for _ in range(6)]
    bf16 = configuration_of({"response.system_fingerprint": "vllm-0.32-bbbb2222"})
    by_config: dict[str, set[str]] = {}
    for run in later:
        for r in run.results:
            by_config.setdefault(configuration_of(r.observation.stack), set()).add(r.comparison.verdict.value)
    assert by_config[bf16] <= {"logprob-drift", "new-configuration"} and "logprob-drift" in by_config[bf16]
    assert all(v <= {"identical", "new-configuration"} for c, v in by_config.items() if c != bf16)


def test_a_third_configuration_is_new_once_per_canary_then_identical(make):
    lab = make(fleet())
    for _ in range(4):
        lab.cycle()
    lab.write(fleet(THIRD))  # the pool grows (the backend is rebuilt)
    runs = [lab.cycle() for _ in range(12)]
    third = configuration_of({"response.system_fingerprint": "third"})
    firsts = [
        r.observation.canary_id
        for run in runs
        for r in run.results
        if configuration_of(r.observation.stack) == third and r.comparison.verdict is Verdict.NEW_CONFIG
    ]
    assert sorted(firsts) == sorted(IDS)  # once per canary
    later = [
        r.comparison.verdict.value
        for run in runs
        for r in run.results
        if configuration_of(r.observation.stack) == third
    ]
    assert later.count("new-configuration") == len(IDS) and set(later) == {"new-configuration", "identical"}


def test_answers_naming_no_configuration_keep_one_baseline_per_canary_and_say_so(make):
    lab = make(scripted(fingerprint="", body=change(at=3, logprob_shift=-0.1)))
    assert verdicts(lab.cycle()) == dict.fromkeys(IDS, "baseline")
    assert verdicts(lab.cycle()) == dict.fromkeys(IDS, "identical")
    assert verdicts(lab.cycle()) == dict.fromkeys(IDS, "logprob-drift")  # today's rule
    assert set(lab.store.baselines("fake", "add")) == {""}
    _, doc = lab.check_json()
    assert doc["configurations"]["fake"]["count"] is None
    assert doc["configurations"]["fake"]["note"].startswith("unknown (no fingerprint)")


def test_calibration_is_per_configuration(make):
    lab = make(fleet(seed=1))  # picks that give each configuration at least 3 of the 12 probes
    for _ in range(4):
        lab.cycle()
    from canaryd.probe.calibrate import calibrate

    results = calibrate(lab.backend(), lab.canaries(), lab.store, k=12, batch_sizes=[1])
    assert {r.configuration for r in results if r.model is not None} == set(
        lab.store.baselines("fake", "add")
    )
    assert all(r.problem is None for r in results) and len(results) == 2 * len(IDS)
    for cid in IDS:
        for configuration in lab.store.baselines("fake", cid):
            assert lab.store.calibration("fake", cid, configuration) is not None
    runs = [lab.cycle() for _ in range(6)]
    assert not [v for run in runs for v in verdicts(run).values() if Verdict(v).is_drift]


# -- gates, pins, metrics -------------------------------------------------------------------------------


def test_check_max_configurations_gates_the_run_naming_backend_and_configurations(make, tmp_path):
    lab = make(fleet(fleet_pick="round-robin", cycle_file=tmp_path / "cycles"))
    lab.close_backends()
    assert lab.cli("check").returncode == 0
    p = lab.cli("check", "--max-configurations", "1")
    assert p.returncode == 1, p.stderr
    (line,) = [x for x in p.stderr.splitlines() if "max-configurations" in x]
    assert line.startswith("canaryd: backend 'fake': served by 2 configurations (") and "more than" in line
    assert "fake: 2 serving configurations (" in p.stdout
    p = lab.cli("check", "--max-configurations", "2", "--json")
    doc = json.loads(p.stdout)
    assert p.returncode == 0 and doc["configurations"]["fake"]["count"] == 2
    assert doc["max_configurations"] == {"limit": 2, "exceeded": []}
    bad = lab.cli("check", "--max-configurations", "0")
    assert bad.returncode == 2 and "--max-configurations: 0" in bad.stderr


def test_over_limit_and_pins_with_configurations(make):
    lab = make(fleet(fleet_pick="round-robin"))
    run = lab.cycle()
    seen = served(run.results)["fake"]
    assert seen.count == 2 and over_limit([seen], 1) and not over_limit([seen], 2)
    pin = Pin(
        "t", "v", {"fake": PinnedBackend("scripted", {"response.system_fingerprint": "x"}, 1, seen.ids)}
    )
    stack = {"response.system_fingerprint": "vllm-0.32-aaaa1111"}
    # a pinned configuration that did not answer this pass is fine; the fingerprint is not diffed
    assert check_pin(pin, {"fake": stack}, "p", {"fake": seen.ids[:1]}).matches
    third = configuration_of({"response.system_fingerprint": "third"})
    report = check_pin(pin, {"fake": stack}, "p", {"fake": (*seen.ids, third)})
    assert not report.matches and report.unpinned == (("fake", third),)


def test_metrics_count_configurations_in_the_window_and_new_ones(make):
    lab = make(fleet(fleet_pick="round-robin"))
    m = Metrics(fingerprint_window_s=3600)
    for _ in range(3):
        m.record(lab.cycle(), now=1000.0)
    value = m.registry.get_sample_value
    assert value("canaryd_backend_configurations", {"backend": "fake"}) == 2
    assert value("canaryd_backend_new_configurations_total", {"backend": "fake"}) == len(IDS)
    m.record(lab.cycle(), now=1000.0 + 7200)  # the window moved on: this pass's configurations only
    assert value("canaryd_backend_configurations", {"backend": "fake"}) == 2


# -- the migration -------------------------------------------------------------------------------------


@pytest.fixture
def url(tmp_path) -> str:
    return f"sqlite:///{tmp_path}/state/canaryd.db"


def test_migration_gives_old_baselines_and_calibrations_their_configuration(url):
    upgrade_to(url, "0005")
    fields = json.dumps({"response.system_fingerprint": "fp_old", "vllm.version": "0.32"})
    t = "'2026-01-01 00:00:00'"
    engine = create_engine(url)
    with engine.begin() as conn:
        for sql in (
            f"INSERT INTO run (backend, instance, started_at, canaries) VALUES ('b', '', {t}, 2)",
            "INSERT INTO request (hash, body) VALUES ('q', '{}')",
            f"INSERT INTO stack (hash, fields, first_seen) VALUES ('s', '{fields}', {t})",
            "INSERT INTO outcome (hash, backend, canary_id, suite, request_ref, request_hash, text, "
            "stack_hash, verdict, comparison) "
            "VALUES ('h1', 'b', 'c', 's', 'q', 'r1', '42', 's', 'baseline', '{}')",
            "INSERT INTO outcome (hash, backend, canary_id, suite, request_ref, request_hash, text, "
            "verdict, comparison) VALUES ('h2', 'b', 'd', 's', 'q', 'r1', '42', 'baseline', '{}')",
            "INSERT INTO event (run_id, outcome_id, started_at, latency_s, headers) "
            "SELECT run.id, outcome.id, '2026-01-01 00:00:00', 0.5, '{}' FROM run, outcome",
            "INSERT INTO baseline (backend, canary_id, observation_id, accepted_at, note) "
            "SELECT 'b', o.canary_id, e.id, '2026-01-01 00:00:00', 'first' FROM event e "
            "JOIN outcome o ON o.id = e.outcome_id",
            "INSERT INTO calibration (backend, canary_id, request_hash, created_at, k, regime, summary, "
            f"model) VALUES ('b', 'c', 'r1', {t}, 2, 'exact', '{{}}', '{{\"m\": 1}}')",
        ):
            conn.exec_driver_sql(sql)
    engine.dispose()
    store = Store(url)
    assert current_revision(store.engine) == SCHEMA_REVISION
    old = configuration_of({"response.system_fingerprint": "fp_old"})
    assert set(store.baselines("b", "c")) == {old}  # found by the next probe of that configuration
    assert set(store.baselines("b", "d")) == {""}  # no stack stored: no configuration
    assert store.baseline("b", "c", old) is not None and store.calibration("b", "c", old) == {"m": 1}
    assert set(store.judging("b").baselines("b", "c")) == {old}
    store.close()


# -- the statistics, on synthetic data with known answers -----------------------------------------------

CANARIES, K, CYCLES, ARL = 8, 19, 240, 10_000.0
OFFSETS = (0.0, -0.04, -0.09)  # three servers' numerics (float32, bfloat16, another build)
SIGMA = 0.004


def _answer(rng: random.Random, canary: int, member: int) -> Observation:
    o = Observation("b", f"c{canary}", "s", datetime(2026, 1, 1, tzinfo=UTC), {}, f"r{canary}")
    lps = [-0.1 - 0.3 * ((canary * 7 + i) % 5) + OFFSETS[member] + rng.gauss(0, SIGMA) for i in range(4)]
    o.text = "abcd"
    o.tokens = [TokenLogprob(ch, min(0.0, lp), ord(ch), None, ()) for ch, lp in zip(o.text, lps, strict=True)]
    o.stack = {"response.system_fingerprint": f"fp{member}"}
    return o


def _simulate(per_configuration: bool, seed: int = 7) -> tuple[int, int, bool]:
    """(probes out beyond noise, drift verdicts, alarm) over CYCLES cycles of a random 3-member fleet."""
    rng = random.Random(seed)
    members = range(len(OFFSETS))
    # each configuration's baseline and calibration (K honest probes), as `baseline calibrate` learns them
    base = {(c, m): _answer(rng, c, m) for c in range(CANARIES) for m in members}
    noise = {key: fit([_answer(rng, *key) for _ in range(K)]) for key in base}
    state, outs, drift = DetectorState(), 0, 0
    for _ in range(CYCLES):
        comparisons = []
        for c in range(CANARIES):
            m = rng.choice(members)
            key = (c, m) if per_configuration else (c, 0)  # one baseline per canary: the first server's
            comparisons.append(compare(base[key], _answer(rng, c, m), correct=None, noise=noise[key]))
        d = decide([f"c{c}" for c in range(CANARIES)], comparisons, state, arl=ARL)
        state = d.state
        outs += len(d.out)
        drift += sum(x.verdict.is_drift for x in d.comparisons)
    return outs, drift, state.alarm


def test_simulation_false_alarms_stay_within_the_bound_per_configuration_and_not_without():
    probes = CANARIES * CYCLES
    outs, drift, alarm = _simulate(per_configuration=True)
    # each probe is out by chance with probability at most 1/(K+1) = 0.05: 96 expected at most, and the
    # binomial's 4-sigma margin keeps the bound from flaking
    bound = probes / (K + 1)
    assert outs <= bound + 4 * (bound * (1 - 1 / (K + 1))) ** 0.5, outs
    assert drift == 0 and not alarm  # ARL 10,000 cycles: no false alarm in 240
    outs1, drift1, alarm1 = _simulate(per_configuration=False)
    # two thirds of the probes land on another server than the baseline's: out, the alarm raised, drift
    assert outs1 > probes / 2 and alarm1 and drift1 > probes / 2


def test_a_configuration_too_rare_in_the_calibration_probes_gets_no_model_and_says_so(tmp_path):
    from canaryd.probe.calibrate import MIN_PROBES, _fit_each

    rng = random.Random(3)
    observed = [_answer(rng, 0, 0) for _ in range(10)] + [_answer(rng, 0, 1) for _ in range(MIN_PROBES - 1)]
    store = Store(f"sqlite:///{tmp_path}/c.db")
    common, rare = (configuration_of(o.stack) for o in (observed[0], observed[-1]))
    results = {r.configuration: r for r in _fit_each("b", "c0", observed, store)}
    assert results[common].model is not None and results[common].problem is None
    assert results[rare].model is None
    assert (
        results[rare].problem
        == f"configuration {rare} answered 2 of 12 probes (fewer than 3): not calibrated"
    )
    assert store.calibration("b", "c0", common) is not None and store.calibration("b", "c0", rare) is None
    store.close()


def test_accept_rebaselines_the_configurations_that_served_the_latest_run(make):
    lab = make(scripted(body=change(at=2, fingerprint="fp_bf16", logprob_shift=-0.1)))
    lab.cycle()
    assert set(verdicts(lab.cycle()).values()) == {"logprob-drift"}  # the only server replaced: drift
    accepted = lab.store.accept_latest("fake")
    new = configuration_of({"response.system_fingerprint": "fp_bf16"})
    assert sorted(a.canary_id for a in accepted) == sorted(IDS) and {a.configuration for a in accepted} == {
        new
    }
    assert verdicts(lab.cycle()) == dict.fromkeys(IDS, "identical")
    fleet_lab = make(fleet(fleet_pick="round-robin", name="pool"))  # the same folder: another backend
    for _ in range(3):
        fleet_lab.cycle("pool")
    assert len({a.configuration for a in fleet_lab.store.accept_latest("pool")}) == 2
