"""The detector fold through the scripted kind: calibration, then cycles whose verdicts the backend's
detector settles (docs/detection.md, "Telling noise from change"; canaryd/judge/stats.py), its state in the
store.

With ``noise`` the scripted engine is non-exact: every probe's logprobs differ a little, so calibration
finds a continuous noise floor and a lone canary beyond it is held as ``within-noise`` until enough
canaries move in one cycle (``min_out``, derived from ``arl``). Without noise calibration finds the exact
regime: any move is drift at once, and the alarm waits for the same canary to move a second time.

``concurrency = 1`` keeps the draws in one order and ``seed = 0`` pins them: the outcome is the same every
run.
"""

from __future__ import annotations

import pytest

from canaryd.judge.stats import DetectorState, min_out_for
from canaryd.probe.calibrate import calibrate
from canaryd.store import Store
from tests.harness.scripted_lab import ScriptedLab, by_id, change, scripted, verdicts

K = 30
IDS = [f"c{i}" for i in range(6)]
SIX = '[suite]\nname = "six"\n[defaults]\nmax_tokens = 6\n' + "".join(
    f'[[canary]]\nid = "{c}"\nmessages = [{{ role = "user", content = "Say {c}." }}]\n'
    f'expect = {{ exact = "{c} ok", answer = "{c} ok" }}\n'
    for c in IDS
)
SHIFT = -0.5  # nats: 50σ of the noise below


@pytest.fixture
def make(tmp_path):
    labs = []

    def build(body: str, noise: float) -> ScriptedLab:
        lab = ScriptedLab(
            tmp_path, scripted(noise=noise, seed=0, concurrency=1, body=body), {"six.toml": SIX}
        )
        labs.append(lab)
        return lab

    yield build
    for lab in labs:
        lab.close()


def calibrated(lab: ScriptedLab, regime: str) -> None:
    lab.cycle()  # the baselines
    saved = calibrate(lab.backend(), lab.canaries(), lab.store, k=K, batch_sizes=[1])
    assert [(c.canary_id, c.problem, c.errors) for c in saved] == [(c, None, 0) for c in IDS]
    assert {c.model.regime.value for c in saved} == {regime} and {c.model.k for c in saved} == {K}
    assert all(lab.store.calibration("fake", c) is not None for c in IDS)


def stored(lab: ScriptedLab) -> DetectorState:
    """The backend's detector as another process would read it: a new Store on the same database."""
    other = Store(lab.config.storage_url)
    try:
        doc = other.fold_detector("fake", lambda s: (None, s))
    finally:
        other.close()
    if isinstance(doc, DetectorState):
        return doc
    return DetectorState(doc["statistic"], doc["cycles"], doc["alarm"], tuple(doc["pending"]))


def test_a_lone_canary_moving_is_within_noise_and_enough_canaries_moving_raise_the_alarm(make):
    body = change(at=3, until=4, canaries=["c0"], logprob_shift=SHIFT)  # one canary, one cycle
    body += change(at=4, until=5, logprob_shift=SHIFT)  # all six, one cycle
    body += change(at=5, canaries=["c0"], logprob_shift=SHIFT)  # one canary again, alarm latched
    lab = make(body, noise=0.01)
    calibrated(lab, "continuous")
    assert min_out_for([1 / (K + 1)] * len(IDS), lab.config.compare.arl) == 4

    honest = lab.cycle()  # cycle 2: only noise moved
    assert set(verdicts(honest).values()) <= {"within-noise", "identical"}
    assert all(r.comparison.evidence.method == "conformal-nn" for r in honest.results)
    assert honest.detector.cycles == 1 and not honest.detector.alarm

    run = lab.cycle()  # cycle 3: c0 beyond its noise (an honest canary may be too, by chance)
    lone = by_id(run)
    c0 = lone["c0"].comparison
    assert c0.evidence.out and c0.evidence.p_value == pytest.approx(1 / (K + 1))
    assert c0.evidence.detail["max_abs_dlogprob"] == pytest.approx(-SHIFT, abs=0.1)
    assert c0.verdict.value == "within-noise"
    out = sum(lone[c].comparison.evidence.out for c in IDS)
    assert out < 4
    assert c0.reasons[0].startswith(f"out alone: {out} of 6 calibrated canaries out (alarm needs 4), e-CUSUM")
    assert all(not lone[c].comparison.verdict.is_drift for c in IDS)
    assert stored(lab) == run.detector  # the pass's detector is the stored one
    assert not run.detector.alarm and run.detector.cycles == 2 and run.detector.statistic > 1

    crowd = lab.cycle()  # cycle 4: six out of six at once: the fast path
    assert verdicts(crowd) == dict.fromkeys(IDS, "logprob-drift")
    assert all(r.comparison.evidence.out for r in crowd.results)
    assert crowd.detector.alarm and crowd.detector.cycles == 3
    assert stored(lab).alarm  # persisted with the pass

    again = by_id(lab.cycle())  # cycle 5: c0 alone again, and now the stored alarm is on
    assert again["c0"].comparison.verdict.value == "logprob-drift"
    assert not any(r.startswith("out alone") for r in again["c0"].comparison.reasons)
    assert stored(lab).alarm and stored(lab).cycles == 4

    # recalibrating starts the detector afresh (the new noise model is the new normal)
    lab.store.accept_latest("fake")
    saved = calibrate(lab.backend(), lab.canaries(), lab.store, k=K, batch_sizes=[1])
    assert all(c.problem is None for c in saved)
    assert stored(lab) == DetectorState()


def test_in_the_exact_regime_a_move_is_drift_at_once_and_the_alarm_waits_for_a_second_cycle(make):
    lab = make(change(at=3, canaries=["c0"], logprob_shift=-1e-3), noise=0.0)
    calibrated(lab, "exact")
    assert verdicts(lab.cycle()) == dict.fromkeys(IDS, "identical")  # cycle 2

    first = by_id(lab.cycle())  # cycle 3: c0 moved by 1e-3 nats; an exact engine never does
    c0 = first["c0"].comparison
    assert c0.verdict.value == "logprob-drift" and c0.evidence.method == "exact"
    assert c0.evidence.threshold == 0 and c0.evidence.out
    assert c0.reasons[-1] == "exact regime: the alarm needs it to move again next cycle"
    assert {c: first[c].comparison.verdict.value for c in IDS[1:]} == dict.fromkeys(IDS[1:], "identical")
    state = stored(lab)
    assert not state.alarm and state.pending == ("c0",)  # carried to the next cycle, in the store

    second = by_id(lab.cycle())  # cycle 4: it moved again: a change that stays, so the alarm
    assert second["c0"].comparison.verdict.value == "logprob-drift"
    assert stored(lab).alarm and stored(lab).pending == ("c0",)


def test_a_one_cycle_blip_in_the_exact_regime_does_not_latch_the_alarm(make):
    lab = make(change(at=3, until=4, canaries=["c0"], logprob_shift=-1e-3), noise=0.0)
    calibrated(lab, "exact")
    lab.cycle()
    assert by_id(lab.cycle())["c0"].comparison.verdict.value == "logprob-drift"  # the blip is on record
    after = lab.cycle()
    assert verdicts(after) == dict.fromkeys(IDS, "identical")
    assert not stored(lab).alarm and stored(lab).pending == ()
