"""Reference checks: a backend's answers re-scored by a reference serving the weights it claims.

The statistics (`canaryd.judge.reference`) on synthetic data with known answers: an honest provider (its
statistic drawn from the reference's own noise) is called a mismatch in at most ``alpha`` of many simulated
cycles, a shifted one nearly always. The wiring through the scripted kind (which scores by teacher forcing:
`scripted.Prober._scored`), the real registry, probe pass, store and CLI: the same answers are never a
mismatch, another answer is one within the cycle, and a reference that cannot answer is an error reason,
never an ``identical``.
"""

from __future__ import annotations

import random

import pytest

from canaryd.errors import InputError
from canaryd.judge.reference import (
    ReferenceDecision,
    canary_p_value,
    decide,
    divergence,
    p_value,
    parting,
    token_divergence,
)
from canaryd.observation import TokenLogprob
from tests.harness.scripted_lab import PLAIN, ScriptedLab, by_id, change, scripted, verdicts


def tok(lp: float, *top: float, tid: int | None = None) -> TokenLogprob:
    return TokenLogprob(f"t{tid}", lp, tid, None, tuple((f"a{i}", x) for i, x in enumerate(top)))


# -- the statistics ----------------------------------------------------------------------------------


def test_a_token_the_reference_ranks_first_diverges_by_zero_and_another_by_the_gap_to_the_best():
    assert token_divergence(tok(-0.1, -0.1, -2.0)) == 0.0
    assert token_divergence(tok(-2.5, -0.5, -2.5)) == pytest.approx(2.0)
    d = divergence([tok(-0.1, -0.1), tok(-1.1, -0.1), tok(-0.3, -0.3)])
    assert (d.mean_nats, d.max_nats, d.tokens) == (pytest.approx(1 / 3), pytest.approx(1.0), 3)
    assert d.logprob_gap is None and not d.retokenized


def test_provider_logprobs_are_compared_where_the_tokenizations_agree_and_flagged_where_not():
    scored = [tok(-0.1, -0.1, tid=1), tok(-0.5, -0.5, tid=2)]
    same = divergence(scored, [tok(-0.3, tid=1), tok(-0.6, tid=2)])
    assert same.logprob_gap == pytest.approx(0.15) and not same.retokenized
    other = divergence(scored, [tok(-0.3, tid=1), tok(-0.6, tid=7)])
    assert other.logprob_gap is None and other.retokenized


def test_a_generated_answers_stop_token_is_not_compared_with_the_scored_text():
    scored = [tok(-0.1, -0.1, tid=1), tok(-0.5, -0.5, tid=2)]
    generated = [tok(-0.2, tid=1), tok(-0.5, tid=2), tok(-0.01, tid=257)]  # the stop token closes it
    d = divergence(scored, generated)
    assert d.logprob_gap == pytest.approx(0.05) and not d.retokenized
    two_more = [*generated, tok(-0.3, tid=9)]
    assert divergence(scored, two_more).retokenized


def test_the_logprob_gap_catches_the_same_answer_from_other_weights():
    # the same tokens (parting 0) whose logprobs moved, against a reference whose own gap is exactly 0
    assert canary_p_value(0.0, [0.0] * 4, 1e-4, [0.0] * 8) == 0.0
    assert canary_p_value(0.0, [0.0] * 4, 0.0, [0.0] * 8) == 1.0
    assert canary_p_value(0.0, [0.0] * 4, None, []) == 1.0  # no provider logprobs: the parting alone
    # conformal regime: the two p-values combine by Bonferroni
    assert canary_p_value(0.0, [0.0], 0.5, [0.1, 0.2, 0.3, 0.4]) == pytest.approx(2 / 5)


def test_parting_is_zero_for_the_same_tokens_and_the_gap_where_two_answers_part():
    own = [tok(-0.1, -0.1, tid=1), tok(-0.2, -0.2, tid=2), tok(-0.3, -0.3, tid=3)]
    assert parting(own, own) == 0.0
    other = [tok(-0.1, -0.1, tid=1), tok(-2.7, -0.2, tid=9), tok(-0.1, -0.1, tid=4)]
    assert parting(other, own) == pytest.approx(2.5)  # only where they part; what follows is not compared
    # one ended where the other went on: the divergence of the token that went on
    assert parting(own[:2], own) == 0.0
    longer = [*own[:2], tok(-1.5, -0.5, tid=5)]
    assert parting(own[:2], longer) == pytest.approx(1.0)


def test_exact_regime_any_statistic_beyond_tolerance_is_out_and_none_within_it():
    assert p_value(1e-6, [0.0] * 5) == 0.0
    assert p_value(0.0, [0.0] * 5) == 1.0
    assert p_value(0.01, [0.0, 0.02], tolerance=0.05) == 1.0  # within tolerance
    assert p_value(0.1, [0.0, 0.02], tolerance=0.05) == 0.0  # the null never passed the tolerance


def test_the_conformal_p_value_counts_the_null_at_or_above_the_statistic():
    null = [0.1, 0.2, 0.3, 0.4]
    assert p_value(0.25, null) == pytest.approx(3 / 5)
    assert p_value(0.5, null) == pytest.approx(1 / 5)
    with pytest.raises(ValueError):
        p_value(0.5, [])


def test_decide_is_a_bonferroni_bound_over_the_cycles_canaries():
    d = decide({"a": 0.004, "b": 0.5, "c": 0.9}, alpha=0.015)
    assert d.mismatch and d.out == ("a",) and d.p_value == pytest.approx(0.012)
    assert not decide({"a": 0.006, "b": 0.5, "c": 0.9}, alpha=0.015).mismatch
    assert decide({}, alpha=0.01) == ReferenceDecision(False, 1.0, ())


def _cycle(rng: random.Random, n_null: int, m: int, shift: float, alpha: float) -> bool:
    """One simulated cycle: the reference's own noise (n_null draws) and m canaries' statistics."""
    null = [rng.expovariate(20.0) for _ in range(n_null)]
    stats = {f"c{i}": rng.expovariate(20.0) + shift for i in range(m)}
    return decide({c: p_value(s, null) for c, s in stats.items()}, alpha).mismatch


def test_an_honest_provider_is_a_mismatch_in_at_most_alpha_of_simulated_cycles():
    rng, alpha, cycles = random.Random(7), 0.05, 4000
    false_alarms = sum(_cycle(rng, 200, 5, 0.0, alpha) for _ in range(cycles))
    # the bound is alpha per cycle; allow 3 binomial standard deviations above it
    assert false_alarms / cycles <= alpha + 3 * (alpha * (1 - alpha) / cycles) ** 0.5
    assert false_alarms > 0  # the bound is not vacuous: the test is not simply always silent


def test_a_provider_shifted_beyond_the_reference_noise_is_caught_nearly_every_cycle():
    rng, cycles = random.Random(11), 500
    caught = sum(_cycle(rng, 200, 5, 0.5, 0.05) for _ in range(cycles))  # 10 noise means
    assert caught / cycles >= 0.99
    weak = sum(_cycle(rng, 200, 5, 0.05, 0.05) for _ in range(cycles))  # one noise mean: some power
    assert 0.05 < weak / cycles < 0.99


# -- through the scripted kind -----------------------------------------------------------------------


@pytest.fixture
def make(tmp_path):
    labs = []

    def build(provider: str, reference: str = "", tail: str = "") -> ScriptedLab:
        backends = provider + (reference or scripted("ref"))
        lab = ScriptedLab(tmp_path, backends, {"plain.toml": PLAIN}, tail=tail)
        labs.append(lab)
        return lab

    yield build
    for lab in labs:
        lab.close()


def test_same_weights_are_never_a_mismatch_and_the_evidence_rides_in_the_comparison(make):
    lab = make(scripted(reference="ref"))
    for _ in range(10):
        run = lab.cycle()
        assert not any(v == "reference-mismatch" for v in verdicts(run).values())
        assert run.reference is not None and run.reference.max_parting_nats == 0.0
    ev = by_id(run)["add"].comparison.reference
    assert ev["backend"] == "ref" and ev["parting_nats"] == 0.0 and not ev["mismatch"]
    assert ev["divergence"]["tokens"] == 2 and ev["divergence"]["logprob_gap"] == 0.0
    assert set(verdicts(run).values()) == {"identical"}


def test_another_answer_is_a_reference_mismatch_in_the_first_cycle_with_its_evidence(make):
    lab = make(scripted(reference="ref", answers={"add": "41"}))
    run = lab.cycle()
    assert verdicts(run)["add"] == "reference-mismatch"
    assert verdicts(run)["capital"] == "baseline"
    c = by_id(run)["add"].comparison
    assert c.reference["mismatch"] and c.reference["parting_nats"] > 0.5 and c.reference["p_value"] == 0.0
    assert any("reference 'ref' would not answer this" in r for r in c.reasons)
    code, out = lab.check_json()
    assert code == 1
    row = next(r for r in out["results"] if r["canary"] == "add" and r["backend"] == "fake")
    assert row["verdict"] == "reference-mismatch" and row["reference"]["divergence"]["mean_nats"] > 0.5


def test_a_mismatch_from_a_later_cycle_on_is_caught_in_that_cycle(make):
    lab = make(scripted(reference="ref", body=change(at=3, text="Paris.", canaries=["capital"])))
    lab.cycle(), lab.cycle()
    run = lab.cycle()
    assert verdicts(run)["capital"] == "reference-mismatch" and verdicts(run)["add"] == "identical"


def test_a_more_severe_verdict_stands_with_the_reference_evidence_beside_it(make):
    lab = make(scripted(reference="ref", body=change(at=2, text="Lyon", canaries=["capital"])))
    lab.cycle()
    c = by_id(lab.cycle())["capital"].comparison
    assert c.verdict.value == "regression" and c.reference["mismatch"]


def test_an_answer_where_the_reference_says_nothing_parts_from_it(make):
    lab = make(scripted(reference="ref"), scripted("ref", answers={"add": ""}))
    c = by_id(lab.cycle())["add"].comparison
    assert c.verdict.value == "reference-mismatch" and c.reference["own_mean_nats"] is None
    assert c.reference["parting_nats"] > 0.5 and c.reference["error"] is None


def test_the_same_answers_with_moved_logprobs_are_a_mismatch_when_the_provider_returns_logprobs(make):
    lab = make(scripted(reference="ref", body=change(at=2, logprob_shift=-0.05)))
    assert set(verdicts(lab.cycle()).values()) == {"baseline"}
    c = by_id(lab.cycle())["add"].comparison
    assert c.verdict.value == "reference-mismatch" and c.reference["parting_nats"] == 0.0
    assert c.reference["divergence"]["logprob_gap"] > 0.01 and c.reference["gap_noise_nats"] == [0.0, 0.0]
    assert any("its logprobs lie" in r for r in c.reasons)


def test_a_noisy_provider_is_held_to_its_own_calibrated_noise_not_the_deterministic_references(make):
    """A provider whose logprobs wander between calls (a GPU's) shows a gap to a deterministic reference
    on the same weights; uncalibrated that gap is a mismatch, once calibrated its own noise floor covers
    it (a configuration it was not calibrated under too), and a shift well beyond that floor is caught."""
    from canaryd.probe.calibrate import calibrate

    moves = change(at=9, fingerprint="fp_new") + change(at=13, logprob_shift=-0.5)
    # without learning, whose window gives a floor before calibration (tests/unit/test_learning.py)
    lab = make(scripted(reference="ref", noise=0.01, seed=0, body=moves), tail="[compare]\nlearn = false\n")
    lab.cycle()
    assert "reference-mismatch" in verdicts(lab.cycle()).values()  # no floor yet: the gap counts
    calibrate(lab.backend(), lab.canaries(), lab.store, k=8, batch_sizes=[1])
    for _ in range(10):  # passes 3 to 12; from 9 on another configuration answers
        run = lab.cycle()
        assert "reference-mismatch" not in verdicts(run).values()
    ev = by_id(run)["add"].comparison.reference
    assert 0.0 < ev["divergence"]["logprob_gap"] < ev["provider_noise_nats"] < 0.1
    c = by_id(lab.cycle())["add"].comparison  # pass 13 on: every logprob 0.5 nats lower
    assert c.verdict.value == "reference-mismatch" and c.reference["divergence"]["logprob_gap"] > 0.3
    assert any("beyond this backend's own noise floor of" in r for r in c.reasons)


def test_a_provider_without_logprobs_is_checked_all_the_same(make):
    lab = make(scripted(reference="ref", logprobs=False, answers={"add": "41"}))
    run = lab.cycle()
    assert verdicts(run)["add"] == "reference-mismatch"
    assert by_id(run)["add"].comparison.reference["divergence"]["logprob_gap"] is None


def test_a_reference_that_fails_is_an_error_reason_never_identical(make):
    lab = make(scripted(reference="ref"), scripted("ref", retries=0, body=change(at=1, error="connect")))
    first = by_id(lab.cycle())["add"].comparison  # the provider's own baseline still stands
    assert first.verdict.value == "baseline" and "connect" in first.reference["error"]
    run = lab.cycle()
    for cid in ("add", "capital", "colors"):
        c = by_id(run)[cid].comparison
        assert c.verdict.value == "error" and any("reference check on 'ref' failed" in r for r in c.reasons)


@pytest.mark.parametrize(
    ("provider", "reference", "message"),
    [
        (scripted(reference="nope"), scripted("ref"), r"backends\.fake\.reference: unknown backend 'nope'"),
        (scripted(reference="fake"), scripted("ref"), "cannot be its own reference"),
        (
            scripted(reference="api"),
            '[[backends]]\nname = "api"\nkind = "openai"\nbase_url = "http://127.0.0.1:9/v1"\nmodel = "m"\n',
            r"backend 'api' \(kind openai\) cannot score",
        ),
        (scripted(reference="ref"), scripted("ref", reference="fake"), "references form a cycle"),
    ],
)
def test_a_reference_is_validated_with_a_one_line_error(make, provider, reference, message):
    with pytest.raises(InputError, match=message):
        make(provider, reference)


def test_the_backends_largest_parting_is_its_reference_divergence_metric(make):
    from canaryd.daemon.metrics import Metrics

    lab = make(scripted(reference="ref", answers={"add": "41"}))
    run = lab.cycle()
    m = Metrics()
    m.record(run)
    m.record(lab.cycle("ref"))  # a backend without a reference exports no such series
    m.publish()
    text = m.exposition()[0].decode()
    value = float(text.split('canaryd_backend_reference_divergence_nats{backend="fake"} ')[1].split()[0])
    assert value == pytest.approx(run.reference.max_parting_nats) and value > 0.5
    assert 'canaryd_backend_reference_divergence_nats{backend="ref"}' not in text


def test_a_reference_that_cannot_be_built_costs_its_checks_not_the_providers_pass(make):
    """A reference whose key is missing, in a pass of its provider alone: the provider is still probed and
    stored (its baselines need no reference); the reference is said to be unavailable."""
    ref = '[[backends]]\nname = "ref"\nkind = "vllm"\nbase_url = "http://127.0.0.1:9/v1"\nmodel = "m"\n'
    lab = make(scripted(reference="ref"), ref + 'api_key_env = "CANARYD_TEST_UNSET_KEY"\n')
    p = lab.cli("check", "--backend", "fake")
    assert p.returncode == 0, p.stderr
    assert "reference_unavailable" in p.stdout + p.stderr and "CANARYD_TEST_UNSET_KEY" in p.stdout + p.stderr
    assert None not in lab.baselines(["add", "capital", "colors"])
