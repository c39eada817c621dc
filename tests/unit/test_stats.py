"""The noise model and the decision rules on synthetic noise with known answers (no server needed).

The synthetic generator mimics batched GPU serving (docs/detection-research.md §2.4): each canary has a few
discrete numerical modes (offsets per coordinate) plus small iid jitter, and the mode mix moves with "load".
"""

import json
import random
from dataclasses import replace
from datetime import UTC, datetime

import pytest

from canaryd.judge.compare import Verdict, compare, decide
from canaryd.judge.evidence import S_FLOOR, cycle_evalue, p_to_e
from canaryd.judge.stats import (
    CalibrationError,
    DetectorState,
    NoiseModel,
    Regime,
    common_prefix,
    cusum,
    fit,
    min_out_for,
    noise_floor,
    score,
)
from canaryd.observation import Observation, TokenLogprob

T0 = datetime(2026, 12, 2, tzinfo=UTC)
VOCAB = ["a", "b", "c", "d", "e", "f"]


def obs(rows: list[list[float]], ids: list[int] | None = None, canary: str = "c") -> Observation:
    """An observation whose position i chose ``VOCAB[ids[i]]`` with top-k logprobs ``rows[i]``."""
    ids = ids or [0] * len(rows)
    tokens = [
        TokenLogprob(VOCAB[t], row[t], t, top=tuple((VOCAB[j], v) for j, v in enumerate(row)))
        for t, row in zip(ids, rows, strict=True)
    ]
    return Observation("b", canary, "s", T0, {}, "req", text="".join(VOCAB[t] for t in ids), tokens=tokens)


def base_rows(rng: random.Random, positions: int = 5) -> list[list[float]]:
    """Peaked next-token distributions, the chosen token (index 0) clearly on top."""
    return [
        [-0.1 - rng.random() * 0.05, *(-3 - 2 * rng.random() for _ in VOCAB[1:])] for _ in range(positions)
    ]


class Modal:
    """A canary served by a nondeterministic engine: K modes of σ_mode plus iid jitter σ_iid."""

    def __init__(self, seed: int, modes: int = 4, sigma_mode: float = 0.02, sigma_iid: float = 0.003):
        self.rng = random.Random(seed)
        self.base = base_rows(self.rng)
        self.offsets = [
            [[self.rng.gauss(0, sigma_mode) for _ in row] for row in self.base] for _ in range(modes)
        ]
        self.sigma_iid = sigma_iid
        self.weights = [1.0] * modes

    def reload(self) -> None:
        """A change of load: the mode mix moves (not the modes)."""
        self.weights = [self.rng.random() for _ in self.weights]

    def draw(self, shift: float = 0.0) -> Observation:
        m = self.rng.choices(range(len(self.offsets)), self.weights)[0]
        rows = [
            [b + o + self.rng.gauss(0, self.sigma_iid) + shift for b, o in zip(br, orow, strict=True)]
            for br, orow in zip(self.base, self.offsets[m], strict=True)
        ]
        return obs(rows)


@pytest.mark.parametrize(
    ("a", "b", "n"),
    [
        (("1", "2", "3"), ("1", "2", "3"), 3),  # the same
        (("1", "2", "3"), ("1", "9", "3"), 1),  # parting inside
        (("1", "2"), ("1", "2", "3"), 2),  # a prefix of the other, either way round
        (("1", "2", "3"), ("1", "2"), 2),
        (("5",), ("6",), 0),
        ((), ("1",), 0),
        ("abc", "abd", 2),  # answers without logprobs: characters
    ],
)
def test_common_prefix_is_where_two_sequences_part(a, b, n):
    assert common_prefix(a, b) == n


# -- EXACT regime: a zero noise floor means any change counts ----------------------------------------


def test_bit_identical_calibration_is_exact_and_any_change_counts():
    rows = base_rows(random.Random(1))
    model = fit([obs(rows) for _ in range(10)])
    assert model.regime is Regime.EXACT and model.threshold == 0.0 and model.signatures == 1
    assert model.summary()["abs_dlogprob_max"] == 0.0 and model.first_divergences() == [None] * 10
    same = score(model, obs(rows))
    assert not same.out and same.p_value == 1.0 and same.statistic == 0.0
    nudged = [list(r) for r in rows]
    nudged[3][2] += 2e-3  # fp32 -> bf16 moves logprobs by about this much, tokens unchanged
    ev = score(model, obs(nudged))
    assert ev.out and ev.method == "exact" and ev.p_value == pytest.approx(1 / 11)
    assert ev.detail["max_abs_dlogprob"] == pytest.approx(2e-3)
    assert ev.e_value == pytest.approx(0.5 * 11**0.5)
    tiny = [list(r) for r in rows]
    tiny[0][0] += 1e-7  # one float32 ulp of a small logprob still counts
    assert score(model, obs(tiny)).out


def test_a_novel_completion_in_the_exact_regime_is_out_even_with_nothing_aligned_moving():
    rows = base_rows(random.Random(2))
    model = fit([obs(rows) for _ in range(5)])
    flipped = score(model, obs(rows, ids=[0, 0, 0, 0, 1]))  # same logprobs, another token chosen last
    assert flipped.out and flipped.detail["novel_completion"]


def test_fit_refuses_too_few_probes_and_mixed_requests():
    rows = base_rows(random.Random(3))
    with pytest.raises(CalibrationError, match="at least 2"):
        fit([obs(rows)])
    other = obs(rows)
    other.request_hash = "other"
    with pytest.raises(CalibrationError, match="same request"):
        fit([obs(rows), other])


def test_noise_model_round_trips_through_json():
    src = Modal(4)
    model = fit([src.draw() for _ in range(12)])
    again = NoiseModel.from_dict(json.loads(json.dumps(model.as_dict())))
    probe = src.draw(shift=0.01)
    assert score(again, probe) == score(model, probe)
    assert again.summary() == model.summary()


# -- MODAL/CONTINUOUS regime: false alarms within the conformal bound --------------------------------


def test_per_canary_false_alarm_rate_stays_within_the_conformal_bound_under_load_changes():
    k, cycles, alarms, total = 30, 400, 0, 0
    for seed in range(5):
        src = Modal(seed)
        model = fit([src.draw() for _ in range(k)])
        assert model.regime is not Regime.EXACT
        summary = model.summary()
        assert 0 < summary["abs_dlogprob_p50"] <= summary["abs_dlogprob_p99"] <= summary["abs_dlogprob_max"]
        for t in range(cycles):
            if t % 24 == 0:
                src.reload()
            alarms += score(model, src.draw()).out
            total += 1
    bound = 1 / (k + 1)
    # binomial margin of 3 standard deviations around the bound
    assert alarms / total <= bound + 3 * (bound * (1 - bound) / total) ** 0.5
    assert alarms / total < 0.01  # in practice the guard band keeps it far below the bound


def test_a_systematic_shift_above_the_jitter_is_out_in_one_probe():
    for seed in range(5):
        src = Modal(seed)
        model = fit([src.draw() for _ in range(30)])
        ev = score(model, src.draw(shift=0.03))
        assert ev.out and ev.p_value == pytest.approx(1 / 31)
        assert ev.detail["max_abs_dlogprob"] > 0.02


def test_pvalues_are_super_uniform_under_the_null():
    src = Modal(7)
    model = fit([src.draw() for _ in range(19)])
    ps = [score(model, src.draw()).p_value for _ in range(2000)]
    for level in (0.1, 0.25, 0.5):
        assert sum(p <= level for p in ps) / len(ps) <= level + 0.03


# -- e-values and the e-CUSUM detector ---------------------------------------------------------------


def conformal_null_p(rng: random.Random, k: int) -> float:
    """A valid discrete conformal p-value under the null: uniform on {1..K+1}/(K+1)."""
    return rng.randint(1, k + 1) / (k + 1)


def test_the_calibrated_e_value_has_mean_at_most_one_under_the_null():
    k = 30
    mean = sum(p_to_e(j / (k + 1)) for j in range(1, k + 2)) / (k + 1)
    assert mean <= 1.0


def test_e_cusum_false_alarm_probability_is_bounded_by_horizon_over_arl():
    rng = random.Random(11)
    arl, horizon, streams, k, canaries = 200.0, 40, 500, 20, 6
    alarms = 0
    for _ in range(streams):
        m = 1.0
        for _ in range(horizon):
            m = cusum(m, cycle_evalue([p_to_e(conformal_null_p(rng, k)) for _ in range(canaries)]))
            if m >= arl:
                alarms += 1
                break
    assert alarms / streams <= horizon / arl  # the e-detector bound: P(alarm by T) <= T/A


def test_e_cusum_catches_a_persistent_small_shift_that_no_single_cycle_proves():
    rng = random.Random(12)
    k, arl = 20, 1000.0
    m, cycles = 1.0, 0
    while m < arl:  # every canary's p-value is small-ish, never the minimum 1/(K+1)
        m = cusum(m, cycle_evalue([p_to_e(rng.randint(2, 4) / (k + 1)) for _ in range(6)]))
        cycles += 1
        assert cycles < 50
    assert cycles > 1


# -- compare() and decide() with a noise model -------------------------------------------------------


def test_compare_with_noise_model_gives_evidence_and_noise_verdicts():
    src = Modal(21)
    model = fit([src.draw() for _ in range(30)])
    base = src.draw()
    honest = src.draw()
    c = compare(base, honest, correct=None, noise=model)
    assert c.verdict in (Verdict.NOISE, Verdict.IDENTICAL) and c.evidence is not None and not c.evidence.out
    shifted = compare(base, src.draw(shift=0.05), correct=None, noise=model)
    assert shifted.verdict is Verdict.LOGPROB_DRIFT and shifted.evidence.out
    assert "beyond the calibrated noise" in shifted.reasons[0]
    d = shifted.as_dict()["evidence"]
    assert d["out"] and d["p_value"] == pytest.approx(1 / 31) and d["method"] == "conformal-nn"


def test_a_stack_change_under_a_probe_within_noise_is_still_a_stack_change():
    src = Modal(22)
    model = fit([src.draw() for _ in range(30)])
    base, now = src.draw(), src.draw()
    base.stack, now.stack = {"vllm.version": "0.32.0"}, {"vllm.version": "0.33.0"}
    c = compare(base, now, correct=None, noise=model)
    assert not c.evidence.out and c.verdict is Verdict.STACK_CHANGE
    assert [(f.field, f.before, f.after) for f in c.stack_changes] == [("vllm.version", "0.32.0", "0.33.0")]


def test_compare_ignores_a_noise_model_of_an_older_request():
    rows = base_rows(random.Random(5))
    model = fit([obs(rows) for _ in range(4)])
    cur = obs(rows)
    cur.request_hash = "newer"
    base = obs(rows)
    base.request_hash = "newer"
    c = compare(base, cur, correct=None, noise=model)
    assert c.verdict is Verdict.IDENTICAL and c.evidence is None
    assert any("older request" in r for r in c.reasons)


def calibrated_fleet(seed: int, n: int):
    """n modal canaries calibrated with K = 30, and a function drawing one cycle with per-canary shifts."""
    sources = [Modal(seed + i) for i in range(n)]
    models = [fit([s.draw() for _ in range(30)]) for s in sources]
    bases = [s.draw() for s in sources]

    def cycle(shift: list[float]):
        return [
            compare(b, s.draw(shift=x), correct=None, noise=m)
            for b, s, m, x in zip(bases, sources, models, shift, strict=True)
        ]

    return [f"c{i}" for i in range(n)], cycle


def test_decide_holds_a_lone_modal_outlier_and_alarms_when_enough_canaries_move():
    ids, cycle = calibrated_fleet(30, 4)
    lone = decide(ids, cycle([0.05, 0, 0, 0]), DetectorState(), arl=1e4, min_out=2)
    assert lone.out == ("c0",) and not lone.state.alarm and lone.raised == ()
    assert lone.comparisons[0].verdict is Verdict.NOISE and "out alone" in lone.comparisons[0].reasons[0]
    assert lone.state.cycles == 1 and lone.cycle_e is not None

    both = decide(ids, cycle([0.05, 0.05, 0, 0]), lone.state, arl=1e4, min_out=2)
    assert both.state.alarm and set(both.out) == {"c0", "c1"} and both.raised == ("min-out",)
    assert [c.verdict for c in both.comparisons[:2]] == [Verdict.LOGPROB_DRIFT] * 2


def test_decide_names_the_rule_that_raised_the_alarm_and_only_in_the_cycle_that_met_it():
    ids, cycle = calibrated_fleet(31, 4)
    moved = cycle([0.05, 0, 0, 0])
    e = decide(ids, moved, DetectorState(), arl=1e4, min_out=5).cycle_e  # min_out 5 of 4: never met
    by_cusum = decide(ids, moved, DetectorState(), arl=e, min_out=5)
    assert by_cusum.state.alarm and by_cusum.raised == ("e-cusum",)
    latched = decide(ids, cycle([0, 0, 0, 0]), by_cusum.state, arl=1e4, min_out=5)
    assert latched.state.alarm and latched.raised == ()  # still on, raised by nothing this cycle


def test_min_out_for_takes_the_fewest_outs_that_chance_explains_once_in_arl_cycles():
    # C(4, m)/31^m: m=3 gives 1.3e-4 > 1e-4, m=4 gives 1.1e-6
    assert min_out_for([1 / 31] * 4, 1e4) == 4
    assert min_out_for([1 / 31] * 4, 100) == 2  # C(4, 2)/961 = 6.2e-3 ≤ 1e-2
    assert min_out_for([1 / 21] * 6, 1e4) == 4  # C(6, 3)/21^3 = 2.2e-3; C(6, 4)/21^4 = 7.7e-5
    assert min_out_for([1 / 21], 1e4) is None  # one canary at K=20 can never prove 1e-4 in one cycle
    assert min_out_for([1 / 31, 0.001], 1e4) is None  # the largest bound decides: 1/31² > 1e-4
    assert min_out_for([1 / 101, 1 / 101], 1e4) == 2


def test_decide_derives_min_out_from_arl_when_unset():
    ids, cycle = calibrated_fleet(40, 4)
    three = decide(ids, cycle([0.05, 0.05, 0.05, 0]), DetectorState(), arl=1e4)
    assert len(three.out) == 3 and not three.state.alarm
    assert "alarm needs 4" in three.comparisons[0].reasons[0]
    four = decide(ids, cycle([0.05] * 4), DetectorState(), arl=1e4)
    assert four.state.alarm and all(c.verdict is Verdict.LOGPROB_DRIFT for c in four.comparisons)


def test_one_cycle_false_alarms_under_derived_min_out_stay_below_one_in_arl():
    k, n, cycles, arl = 20, 6, 600, 1e4
    sources = [Modal(60 + i) for i in range(n)]
    models = [fit([s.draw() for _ in range(k)]) for s in sources]
    bases = [s.draw() for s in sources]
    ids = [f"c{i}" for i in range(n)]
    alarms = outs = 0
    for t in range(cycles):
        if t % 24 == 0:
            for s in sources:
                s.reload()
        comps = [
            compare(b, s.draw(), correct=None, noise=m)
            for b, s, m in zip(bases, sources, models, strict=True)
        ]
        d = decide(ids, comps, DetectorState(), arl=arl)  # a fresh detector: only the one-cycle path can fire
        alarms += d.state.alarm
        outs += len(d.out)
    assert alarms == 0  # the bound is cycles/arl = 0.06 expected
    assert outs / (n * cycles) <= 1 / (k + 1)  # canaries do go out alone: the fast path must not trust one


def test_decide_passes_exact_changes_through_and_without_evidence_changes_nothing():
    rows = base_rows(random.Random(8))
    model = fit([obs(rows) for _ in range(5)])
    moved = [list(r) for r in rows]
    moved[0][0] -= 1e-3
    c = compare(obs(rows), obs(moved), correct=None, noise=model)
    d = decide(["x"], [c], DetectorState(), arl=1e4, min_out=2)
    assert d.comparisons[0].verdict is Verdict.LOGPROB_DRIFT  # the verdict does not wait
    assert not d.state.alarm and d.state.pending == ("x",)
    assert "move again next cycle" in d.comparisons[0].reasons[-1]
    again = decide(["x"], [c], d.state, arl=1e4, min_out=2)
    assert again.state.alarm and again.comparisons[0].verdict is Verdict.LOGPROB_DRIFT
    assert again.raised == ("exact",)  # one canary out never meets min_out 2
    plain = compare(obs(rows), obs(moved), correct=None)
    untouched = decide(["x"], [plain], DetectorState(), arl=1e4, min_out=2)
    assert (
        untouched.comparisons == [plain] and untouched.cycle_e is None and untouched.state == DetectorState()
    )


def test_spread_never_falls_below_the_float_floor():
    rows = base_rows(random.Random(9))
    model = fit([obs(rows) for _ in range(4)])
    assert min(model.spread.values()) == S_FLOOR


def test_an_exact_regime_blip_cannot_latch_the_alarm_but_a_change_that_stays_does():
    rows = base_rows(random.Random(10))
    model = fit([obs(rows) for _ in range(5)])
    moved = [list(r) for r in rows]
    moved[1][0] += 1e-6
    same = compare(obs(rows), obs(rows), correct=None, noise=model)
    blip = compare(obs(rows), obs(moved), correct=None, noise=model)
    ids = ["x", "y", "z"]
    state = DetectorState()
    # x blips, the next cycle is clean, then y blips, then z: never the same canary twice in a row
    for cycle in ([blip, same, same], [same] * 3, [same, blip, same], [same, same, blip]):
        d = decide(ids, cycle, state, arl=1e4)
        state = d.state
        assert not state.alarm
    assert state.pending == ("z",) and state.cycles == 4
    # an error cycle (no evidence) keeps the pending canary; it moving again is the alarm
    assert decide(ids, [replace(same, evidence=None)] * 3, state, arl=1e4).state == state
    assert decide(ids, [same, same, blip], state, arl=1e4).state.alarm
    # a blip of min_out canaries at once is as unlikely as min_out conformal outs: the fast path takes it
    assert decide(ids, [blip, blip, same], DetectorState(), arl=1e4, min_out=2).state.alarm


def test_the_noise_floor_is_the_largest_move_between_two_honest_probes_where_they_align():
    rows = [[-0.1, -3.0], [-0.2, -4.0]]
    assert noise_floor(fit([obs(rows)] * 3)) == 0.0  # the exact regime
    moved = [[-0.1, -3.0], [-0.2, -4.3]]
    assert noise_floor(fit([obs(rows), obs(moved), obs(rows)])) == pytest.approx(0.3)
    # after the position where two probes part (same context: compared) the contexts differ: not compared
    three = [*rows, [-0.5, -1.0]]
    parted = fit([obs(three, [0, 0, 0]), obs([[-0.15, -3.0], [-0.25, -3.9], [-7.0, -0.01]], [0, 1, 1])])
    assert noise_floor(parted) == pytest.approx(0.1)
