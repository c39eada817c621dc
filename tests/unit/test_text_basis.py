"""Judging without logprobs, through the scripted kind, the probe pass and a real SQLite store.

A backend that answers without logprobs (``logprobs = false``: Anthropic's or Gemini's OpenAI-compatible
endpoints, most OpenRouter providers) still forms a baseline and is judged on what it has: the text,
usage (prompt, completion and reasoning tokens), fingerprint and stack, and with a calibration the spread
of reasoning tokens and latency. Every verdict names its basis (docs/detection.md, "Judging without
logprobs").
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime

import pytest

from canaryd.daemon.metrics import Metrics
from canaryd.judge.compare import Verdict, compare, decide
from canaryd.judge.evidence import GUARD
from canaryd.judge.signals import LATENCY_MIN_S, LATENCY_RATIO
from canaryd.judge.stats import DetectorState, NoiseModel, fit, min_out_for
from canaryd.observation import Observation
from canaryd.probe.calibrate import calibrate
from canaryd.report.record import build_record, to_markdown
from tests.harness.scripted_lab import ScriptedLab, by_id, change, scripted, verdicts

IDS = ["add", "capital", "colors"]

NO_LEARNING = "[compare]\nlearn = false\n"  # for tests whose subject is judging without a model


@pytest.fixture
def make(tmp_path):
    labs = []

    def build(backends: str, suites: dict[str, str] | None = None, **kwargs) -> ScriptedLab:
        lab = ScriptedLab(tmp_path, backends, suites, **kwargs)
        labs.append(lab)
        return lab

    yield build
    for lab in labs:
        lab.close()


def bases(run) -> set[str]:
    return {r.comparison.basis for r in run.results}


# -- plain canaries on the text basis -------------------------------------------------------------------


def test_a_text_basis_baseline_forms_and_an_unchanged_pass_is_identical(make):
    lab = make(scripted(logprobs=False, reasoning_tokens=900))
    first = lab.cycle()
    assert verdicts(first) == dict.fromkeys(IDS, "baseline") and bases(first) == {"text"}
    for r in first.results:
        o = r.observation
        assert o.ok and not o.has_logprobs and o.tokens == [] and o.reasoning_tokens == 900
        assert o.completion_tokens == len(o.text) + 900  # OpenAI-style usage counts the reasoning in
        base = lab.store.baseline("fake", o.canary_id)
        assert base.observation_id == r.observation_id and not base.observation.has_logprobs
        assert base.observation.reasoning_tokens == 900

    second = lab.cycle()
    assert verdicts(second) == dict.fromkeys(IDS, "identical") and bases(second) == {"text"}
    for r in second.results:
        c = r.comparison
        assert c.text_identical and c.delta.first_divergence is None and c.delta.max_abs_dlogprob is None
        assert c.reasons == () and c.as_dict()["basis"] == "text"
    assert lab.baselines(IDS) == [r.observation_id for r in first.results]

    metrics = Metrics()
    metrics.record(second)
    get = metrics.registry.get_sample_value
    assert get("canaryd_backend_text_basis_canaries", {"backend": "fake"}) == len(IDS)
    assert (
        get("canaryd_canary_logprob_delta_max", {"backend": "fake", "canary": "add"}) is None
    )  # no logprobs


def test_a_changed_answer_on_text_is_answer_drift_from_the_first_differing_character(make):
    lab = make(scripted(logprobs=False, body=change(at=2, canaries=["capital"], text="Parix")))
    lab.cycle()
    run = by_id(lab.cycle())
    c = run["capital"].comparison
    assert c.verdict is Verdict.REGRESSION  # "Parix" fails the canary's regex: was correct, now wrong
    assert c.basis == "text" and c.delta.first_divergence == 4 and not c.text_identical
    assert {run[i].comparison.verdict for i in ("add", "colors")} == {Verdict.IDENTICAL}

    lab = make(scripted(name="other", logprobs=False, body=change(at=2, canaries=["add"], text="42.")))
    lab.cycle("other")
    moved = by_id(lab.cycle("other"))["add"].comparison
    assert moved.verdict is Verdict.ANSWER_DRIFT and moved.correct  # still correct, but it moved
    assert moved.reasons[0] == "text differ from character 2" and moved.basis == "text"


def test_prompt_token_growth_is_a_stack_change_and_a_rotated_fingerprint_a_new_configuration(make):
    body = change(at=2, canaries=["add"], prompt_tokens_delta=12) + change(
        at=2, canaries=["capital"], fingerprint="fp_rotated"
    )
    lab = make(scripted(logprobs=False, body=body))
    lab.cycle()
    run = by_id(lab.cycle())
    grown = run["add"].comparison
    assert grown.verdict is Verdict.STACK_CHANGE and grown.basis == "text" and grown.prompt_tokens_changed
    assert any(
        r.startswith("prompt tokens ") and r.endswith(f" -> {int(r.split()[2]) + 12}") for r in grown.reasons
    )
    rotated = run["capital"].comparison  # another serving configuration: its first answer, on text
    assert rotated.verdict is Verdict.NEW_CONFIG and rotated.fingerprint_changed and rotated.basis == "text"
    assert not rotated.stack_changes and not rotated.verdict.is_drift
    assert rotated.reasons[1].endswith("would be identical")  # the same text: only the identity moved
    assert run["colors"].comparison.verdict is Verdict.IDENTICAL


def test_uncalibrated_reasoning_tokens_that_move_are_answer_drift(make):
    lab = make(
        scripted(logprobs=False, reasoning_tokens=900, body=change(at=2, reasoning_tokens=300)),
        tail=NO_LEARNING,
    )
    lab.cycle()
    run = lab.cycle()
    assert verdicts(run) == dict.fromkeys(IDS, "answer-drift")
    c = run.results[0].comparison
    assert c.text_identical and c.basis == "text" and c.evidence is None
    assert (
        c.reasons[0]
        == "hidden reasoning tokens 900 -> 300 (uncalibrated: `baseline calibrate` learns their spread)"
    )


@pytest.mark.parametrize("first", [True, False], ids=["logprobs-then-none", "none-then-logprobs"])
def test_a_basis_change_alone_is_judged_on_text_with_the_reason_and_is_no_drift(make, first):
    # without learning: an exact first contact's model would add its own reason (tests/unit/test_learning.py)
    lab = make(scripted(logprobs=first, body=change(at=2, logprobs=not first)), tail=NO_LEARNING)
    assert bases(lab.cycle()) == {"logprobs" if first else "text"}
    run = lab.cycle()
    assert verdicts(run) == dict.fromkeys(IDS, "identical") and bases(run) == {"text"}
    why = (
        "the baseline has logprobs, this answer none: judged on text"
        if first
        else "the baseline has no logprobs: judged on text"
    )
    assert all(r.comparison.reasons == (why,) for r in run.results)
    assert lab.baselines(IDS) == [r.observation_id - len(IDS) for r in run.results]  # the baseline stays


def test_a_required_logprob_answer_without_them_is_an_error_never_identical(make):
    lab = make(scripted(require_logprobs=True, body=change(at=2, logprobs=False)))
    lab.cycle()
    run = lab.cycle()
    assert verdicts(run) == dict.fromkeys(IDS, "error")
    assert {r.observation.error_kind.value for r in run.results} == {"no_logprobs"}


# -- calibrated reasoning tokens -------------------------------------------------------------------------

K = 30
SIX_IDS = [f"c{i}" for i in range(6)]
SIX = '[suite]\nname = "six"\n[defaults]\nmax_tokens = 6\n' + "".join(
    f'[[canary]]\nid = "{c}"\nmessages = [{{ role = "user", content = "Say {c}." }}]\n'
    f'expect = {{ exact = "{c} ok", answer = "{c} ok" }}\n'
    for c in SIX_IDS
)


def test_reasoning_tokens_900_to_300_are_caught_after_calibration_and_the_spread_is_not(make):
    """A provider silently lowering its reasoning effort: the same answers, far fewer hidden tokens."""
    body = change(at=4, reasoning_tokens=300)
    lab = make(
        scripted(logprobs=False, reasoning_tokens=900, reasoning_jitter=2, seed=0, concurrency=1, body=body),
        {"six.toml": SIX},
    )
    lab.cycle()  # the baselines
    saved = calibrate(lab.backend(), lab.canaries(), lab.store, k=K, batch_sizes=[1])
    assert [(c.canary_id, c.problem) for c in saved] == [(c, None) for c in SIX_IDS]
    model = saved[0].model
    assert model.basis == "text" and set(model.signals) == {"reasoning_tokens"}  # latency 0: not a signal
    assert 897 < model.signals["reasoning_tokens"].median < 903
    stored = NoiseModel.from_dict(lab.store.calibration("fake", "c0"))
    assert stored.signal_values == model.signal_values  # the calibration's JSON keeps the K counts

    for _ in range(2):  # cycles 2 and 3: the counts jitter within their calibrated spread
        honest = lab.cycle()
        assert set(verdicts(honest).values()) <= {"identical", "within-noise"}
        assert not any(r.comparison.evidence.out for r in honest.results)
        assert bases(honest) == {"text"} and not honest.detector.alarm
    moved_within = [r for r in honest.results if r.comparison.verdict is Verdict.NOISE]
    assert all(r.comparison.reasons[0].startswith("within the calibrated noise") for r in moved_within)

    dropped = lab.cycle()  # cycle 4: 300 reasoning tokens everywhere
    assert verdicts(dropped) == dict.fromkeys(SIX_IDS, "answer-drift") and dropped.detector.alarm
    for r in dropped.results:
        c, ev = r.comparison, r.comparison.evidence
        assert c.text_identical and c.basis == "text" and ev.basis == "text"
        assert ev.out and ev.detail["signal"] == "reasoning_tokens" and 298 <= ev.detail["value"] <= 302
        assert ev.p_value == pytest.approx(2 / (K + 1))  # 1/(K+1), Bonferroni over answer + reasoning
        assert ev.detail["signals_scored"] == 2 and set(ev.detail["signals"]) == {
            "answer",
            "reasoning_tokens",
        }
        assert re.fullmatch(
            r"hidden reasoning tokens (89|90)\d -> (29|30)\d, beyond the calibrated spread: "
            r"reasoning_tokens (29|30)\d "
            r"vs calibrated 89\d\.\.90\d \(D \d+ vs threshold [\d.]+, conformal-nn, p 0\.0323\)",
            c.reasons[0],
        ), c.reasons[0]
        doc = c.as_dict()
        assert doc["basis"] == "text" and doc["evidence"]["basis"] == "text"


def test_calibration_refuses_a_baseline_whose_reasoning_tokens_lie_outside_the_spread(make):
    lab = make(
        scripted(logprobs=False, reasoning_tokens=900, body=change(at=2, reasoning_tokens=400)),
        {"six.toml": SIX},
        tail=NO_LEARNING,  # no model from first contact: only what calibrate saves is in the store
    )
    lab.cycle()  # the baselines, at 900
    lab.backend().snapshot()  # cycle 2: the calibration probes all answer 400
    saved = calibrate(lab.backend(), lab.canaries(), lab.store, k=4, batch_sizes=[1])
    assert all(c.problem and "its reasoning tokens 900, calibrated 400..400" in c.problem for c in saved)
    assert lab.store.calibration("fake", "c0") is None


# -- sampled canaries ------------------------------------------------------------------------------------

COIN = """
[suite]
name = "coin"
[[canary]]
id = "coin"
messages = [{ role = "user", content = "Flip a coin." }]
decoding = { temperature = 1.0, samples = 40, max_tokens = 5, seed = 0 }
expect = { choices = ["heads", "tails"] }
"""


def test_a_sampled_canary_without_logprobs_runs_its_answer_test_on_text(make):
    lab = make(
        scripted(
            logprobs=False, distribution={"coin": {"heads": 3, "tails": 1}}, body=change(at=3, text="tails")
        ),
        {"coin.toml": COIN},
    )
    assert {r.comparison.verdict.value for r in lab.cycle().results} == {"baseline"}
    same = lab.cycle().results
    assert {r.comparison.verdict.value for r in same} == {"identical"} and bases_of(same) == {"text"}
    moved = lab.cycle().results  # every draw now "tails": the answer distribution moved
    assert {r.comparison.verdict.value for r in moved} == {"answer-drift"} and bases_of(moved) == {"text"}
    c = moved[0].comparison
    assert c.evidence.method == "two-sample-answers" and c.evidence.out and c.evidence.basis == "text"
    assert c.evidence.detail["logprob"]["completions_shared"] == 0  # nothing to compare there
    assert "no logprobs: answers judged on text alone" in c.reasons


def bases_of(results) -> set[str]:
    return {r.comparison.basis for r in results}


# -- where the basis is shown ----------------------------------------------------------------------------


def test_the_basis_is_in_check_json_and_in_the_record(make, tmp_path):
    lab = make(
        scripted(
            logprobs=False,
            cycle_file=tmp_path / "cycles",
            body=change(at=2, text="Lyon", canaries=["capital"]),
        )
    )
    code, first = lab.check_json()
    assert code == 0 and {r["basis"] for r in first["results"]} == {"text"}
    code, second = lab.check_json()
    assert code == 1
    got = {r["canary"]: (r["verdict"], r["basis"]) for r in second["results"]}
    assert got == {
        "add": ("identical", "text"),
        "capital": ("regression", "text"),
        "colors": ("identical", "text"),
    }

    run_id = max(r["run_id"] for r in second["results"])
    rec = build_record(lab.store, [run_id])
    assert {c["canary"]: c["basis"] for c in rec["canaries"]} == dict.fromkeys(IDS, "text")
    assert [(c["canary"], c["basis"]) for c in rec["changes"]] == [("capital", "text")]
    md = to_markdown(rec)
    assert "| backend | canary | observation | verdict | basis | correct | text |" in md
    assert ": regression on text; " in md


# -- latency: a signal with a higher bar -----------------------------------------------------------------


def _obs(latency: float, text: str = "42") -> Observation:
    o = Observation("b", "c", "s", datetime(2026, 1, 1, tzinfo=UTC), {}, "r1", latency_s=latency)
    o.text, o.has_logprobs, o.prompt_tokens, o.completion_tokens = text, False, 10, 2
    return o


def test_latency_is_compared_only_against_a_calibration_and_then_with_a_higher_bar():
    base = _obs(0.50)
    uncalibrated = compare(base, _obs(5.0), correct=True)
    assert uncalibrated.verdict is Verdict.IDENTICAL and uncalibrated.latency is None

    model = fit([_obs(0.45 + 0.01 * i) for i in range(20)])  # 0.45 .. 0.64 s
    assert set(model.signals) == {"latency_s"} and model.basis == "text"
    slower = compare(base, _obs(0.80), correct=True, noise=model)  # beyond every probe, but not 0.5 s
    assert slower.verdict is Verdict.IDENTICAL and not slower.latency.out and slower.reasons == ()
    assert slower.evidence.method == "exact" and slower.evidence.p_value == 1.0  # the answer's, untouched
    lat, fitted = slower.latency, model.signals["latency_s"]
    assert lat.p_value == pytest.approx(1 / 21) and lat.basis == "text"
    assert lat.statistic > (1 + GUARD) * max(fitted.loo)  # beyond every honest probe ...
    assert math.log(fitted.median_s + LATENCY_MIN_S) - fitted.median > math.log(LATENCY_RATIO)
    # ... but the bar is 0.5 s over the median (here more than 1.5×)
    assert lat.threshold == pytest.approx(
        (math.log(fitted.median_s + LATENCY_MIN_S) - fitted.median) / fitted.spread
    )
    # a loopback's milliseconds: ten times slower is still not half a second
    quick = fit([_obs(0.004 + 0.0001 * i) for i in range(20)])
    assert not compare(_obs(0.005), _obs(0.05), correct=True, noise=quick).latency.out

    far = compare(base, _obs(2.0), correct=True, noise=model)
    assert far.verdict is Verdict.IDENTICAL and far.latency.out and not far.evidence.out
    assert far.reasons[0].startswith(
        "latency beyond the calibrated spread: latency_s 2 s vs calibrated 0.45..0.64 s"
    )
    assert far.as_dict()["latency"]["out"] and far.as_dict()["latency"]["detail"]["value"] == pytest.approx(
        2.0
    )
    alone = decide(["c"], [far], DetectorState(), arl=10_000)  # one canary: never drift on latency
    assert alone.comparisons[0].verdict is Verdict.IDENTICAL and not alone.state.alarm
    assert alone.comparisons[0].reasons[-1] == (
        "latency out on 1 of 1 calibrated canaries: no drift alone (too few canaries to tell)"
    )


@pytest.mark.parametrize("slow", [3, 4])
def test_latency_out_on_enough_canaries_at_once_is_a_backend_wide_stack_change(slow):
    model = fit([_obs(0.45 + 0.01 * i) for i in range(20)])
    ids = [f"c{i}" for i in range(6)]
    cmps = [compare(_obs(0.5), _obs(2.0 if i < slow else 0.5), correct=True, noise=model) for i in range(6)]
    assert min_out_for([1 / 21] * 6, 10_000) == 4
    d = decide(ids, cmps, DetectorState(), arl=10_000)
    got = [c.verdict for c in d.comparisons]
    if slow == 4:
        assert got == [Verdict.STACK_CHANGE] * 4 + [Verdict.IDENTICAL] * 2
        assert (
            d.comparisons[0].reasons[-1]
            == "latency out on 4 of 6 calibrated canaries at once: a backend-wide shift"
        )
    else:
        assert got == [Verdict.IDENTICAL] * 6
        assert d.comparisons[0].reasons[-1] == (
            "latency out on 3 of 6 calibrated canaries: no drift alone (a shift needs 4)"
        )
    assert not d.state.alarm and d.state.statistic <= 1  # latency never feeds the e-CUSUM


def test_a_held_back_drift_never_hides_a_moved_stack():
    def probe(reasoning: int, version: str) -> Observation:
        o = _obs(0.5)
        o.reasoning_tokens, o.stack = reasoning, {"engine.version": version}
        return o

    model = fit([probe(880 + 2 * i, "1") for i in range(20)])
    c = compare(probe(900, "1"), probe(300, "2"), correct=True, noise=model)
    assert c.verdict is Verdict.ANSWER_DRIFT and c.evidence.out and c.evidence.method == "conformal-nn"
    settled = decide(["c"], [c], DetectorState(), arl=10_000).comparisons[0]  # one canary: held back ...
    assert settled.verdict is Verdict.STACK_CHANGE and settled.reasons[0].startswith("out alone: 1 of 1")
    assert len(settled.stack_changes) == 1  # ... as the stack change it also is, not as within-noise


def test_an_uncalibrated_answer_change_beside_calibrated_signals_is_never_held_back():
    """Calibrated on logprobs, answered without: the text is judged uncalibrated, and its drift stands."""
    from canaryd.observation import TokenLogprob

    def with_logprobs(latency: float) -> Observation:
        o = _obs(latency)
        o.has_logprobs, o.tokens = True, [TokenLogprob("4", -0.1), TokenLogprob("2", -0.2)]
        return o

    model = fit([with_logprobs(0.45 + 0.01 * i) for i in range(20)])
    assert model.basis == "logprobs"
    c = compare(with_logprobs(0.5), _obs(0.5, text="41"), correct=None, noise=model)
    assert c.verdict is Verdict.ANSWER_DRIFT and c.basis == "text" and c.evidence is None
    assert "calibrated on logprobs, compared on text: the answer judged uncalibrated" in c.reasons
    assert decide(["c"], [c], DetectorState(), arl=10_000).comparisons[0].verdict is Verdict.ANSWER_DRIFT
