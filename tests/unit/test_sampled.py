"""Sampled canaries: the statistics on synthetic draws with known answers, the verdicts, and the store wiring.

Simulations use fixed seeds, so every figure asserted here is reproducible; bounds are the nominal rate plus
a binomial margin of three standard deviations for the number of simulated cases.
"""

import math
import random
from datetime import UTC, datetime
from pathlib import Path

import pytest

from canaryd.canaries import Expect, load_suite
from canaryd.config import CompareConfig
from canaryd.errors import InputError
from canaryd.judge.compare import Comparison, Verdict
from canaryd.judge.sampled import (
    answer_test,
    compare_samples,
    logprob_test,
    newcombe,
    permutations_for,
    wilson,
)
from canaryd.observation import ErrorKind, Observation, TokenLogprob, canonical_digest
from canaryd.probe.run import Result
from canaryd.probe.shapes import SAMPLED
from canaryd.report.tables import results_table
from canaryd.store import Store

T0 = datetime(2025, 1, 1, tzinfo=UTC)


def sample(text: str, logprob: float, request_hash: str = "h", stack: dict | None = None) -> Observation:
    """One synthetic draw: a one-token answer with its chosen-token logprob."""
    return Observation(
        "b",
        "c",
        "s",
        T0,
        {"seed": 0},
        request_hash,
        text=text,
        tokens=[TokenLogprob(text, logprob, token_id=ord(text[0]) if text else 0)],
        stack=stack if stack is not None else {"engine": "v1"},
    )


def draws(rng: random.Random, n: int, probs: dict[str, float], shift: float = 0.0) -> list[Observation]:
    """n draws from a categorical answer distribution; each answer's logprob is its log-probability plus
    per-sample noise (as a sampled engine's chosen-token logprob varies with the rest of the text), at most
    0 like every logprob (a positive one is an invalid answer, refused before any comparison)."""
    answers, weights = zip(*probs.items(), strict=True)
    picked = rng.choices(answers, weights, k=n)
    return [sample(a, min(0.0, math.log(probs[a]) + shift + rng.gauss(0, 0.3))) for a in picked]


# -- intervals ------------------------------------------------------------------------------------------
def test_wilson_known_values_and_edges():
    # Newcombe (1998), Statistics in Medicine 17:857, table I (method 3)
    assert [round(x, 4) for x in wilson(81, 263)] == [0.2553, 0.3662]
    assert [round(x, 4) for x in wilson(15, 148)] == [0.0624, 0.1605]
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == 1.0
    assert wilson(0, 0) == (0.0, 1.0)


def test_newcombe_known_value():
    # Newcombe (1998), Statistics in Medicine 17:873, table II, method 10: examples (a) and (d)
    assert [round(x, 4) for x in newcombe(56, 70, 48, 80)] == [0.0524, 0.3339]
    assert [round(x, 4) for x in newcombe(9, 10, 3, 10)] == [0.1705, 0.8090]


def test_wilson_covers_the_true_rate_95_percent_of_the_time():
    rng = random.Random(1)
    hits, runs = 0, 2000
    for _ in range(runs):
        p, n = rng.uniform(0.05, 0.95), rng.randint(20, 100)
        k = sum(rng.random() < p for _ in range(n))
        low, high = wilson(k, n)
        hits += low <= p <= high
    coverage = hits / runs
    assert abs(coverage - 0.95) <= 0.02, coverage


def test_newcombe_covers_the_true_difference_95_percent_of_the_time():
    rng = random.Random(2)
    hits, runs = 0, 2000
    for _ in range(runs):
        p1, p0 = rng.uniform(0.05, 0.95), rng.uniform(0.05, 0.95)
        n1, n0 = rng.randint(20, 100), rng.randint(20, 100)
        k1 = sum(rng.random() < p1 for _ in range(n1))
        k0 = sum(rng.random() < p0 for _ in range(n0))
        low, high = newcombe(k1, n1, k0, n0)
        hits += low <= p1 - p0 <= high
    coverage = hits / runs
    assert abs(coverage - 0.95) <= 0.02, coverage


# -- the tests themselves -------------------------------------------------------------------------------
def test_answer_test_p_value_form_and_threshold():
    same = answer_test(["a", "b"] * 10, ["b", "a"] * 10, level=0.05, permutations=999)
    assert same.statistic == 0.0 and same.p_value == 1.0 and not same.reject
    apart = answer_test(["a"] * 20, ["b"] * 20, level=0.05, permutations=999)
    assert apart.statistic == 1.0 and apart.p_value == 1 / 1000 and apart.reject
    assert apart.permutations == 999
    # the reported bar is exactly the decision: statistic > threshold ⇔ p ≤ level
    rng = random.Random(3)
    for _ in range(40):
        a = rng.choices("abc", [0.5, 0.3, 0.2], k=25)
        b = rng.choices("abc", [0.35, 0.35, 0.3], k=25)
        t = answer_test(a, b, level=0.05, permutations=499)
        assert t.reject == (t.p_value <= 0.05)


def test_logprob_test_interval_and_decision():
    rng = random.Random(4)
    base = [(a, rng.gauss(-2.0, 0.3)) for a in "xy" * 20]
    cur = [(a, rng.gauss(-1.5, 0.3)) for a in "xy" * 20]
    lp = logprob_test(base, cur, level=0.0005)
    assert lp.test.reject and lp.test.p_value <= 0.0005
    assert lp.interval[0] < lp.difference < lp.interval[1]
    assert lp.interval[0] < 0.5 < lp.interval[1]  # the true shift
    assert (lp.shared, lp.samples) == (2, (40, 40))
    assert lp.test.permutations == permutations_for(0.0005) == 19999
    empty = logprob_test([("x", -1.0)], [("y", -1.0)], level=0.05)
    assert empty.test.p_value == 1.0 and not empty.test.reject and empty.difference is None


def test_logprob_test_compares_within_completions():
    """A moved answer mix is the answer test's business; the same completions at other logprobs are ours."""
    lp_of = {"yes": -0.2, "no": -1.6}  # a deterministic engine: each completion always has one logprob
    mix = logprob_test(
        [(a, lp_of[a]) for a in ["yes"] * 24 + ["no"] * 6],
        [(a, lp_of[a]) for a in ["yes"] * 12 + ["no"] * 18],
        level=0.0005,
    )
    assert mix.difference == pytest.approx(0.0, abs=1e-12) and mix.test.p_value == 1.0 and not mix.test.reject
    shifted = logprob_test(
        [(a, lp_of[a]) for a in ["yes"] * 24 + ["no"] * 6],
        [(a, lp_of[a] + 0.01) for a in ["yes"] * 24 + ["no"] * 6],
        level=0.0005,
    )
    assert shifted.difference == pytest.approx(0.01) and shifted.test.reject
    assert shifted.interval == pytest.approx((0.01, 0.01))


def test_too_few_permutations_for_the_level_is_refused():
    with pytest.raises(ValueError, match="cannot reach"):
        answer_test(["a"], ["b"], level=0.0005, permutations=999)


# -- verdicts -------------------------------------------------------------------------------------------
PROBS = {"yes": 0.5, "no": 0.3, "maybe": 0.2}


def test_false_alarm_rate_under_the_null_is_within_alpha():
    """Same engine both sides: over many simulated cycles, drift verdicts stay within alpha."""
    rng = random.Random(5)
    alpha, cycles = 0.05, 400
    alarms = 0
    expect = Expect(exact="yes")
    for _ in range(cycles):
        c = compare_samples(
            draws(rng, 30, PROBS), draws(rng, 30, PROBS), expect=expect, alpha=alpha, permutations=999
        )
        assert c.verdict in (Verdict.NOISE, Verdict.ANSWER_DRIFT, Verdict.LOGPROB_DRIFT, Verdict.REGRESSION)
        alarms += c.verdict.is_drift
    bound = alpha + 3 * math.sqrt(alpha * (1 - alpha) / cycles)
    assert alarms / cycles <= bound, (alarms, cycles)


@pytest.mark.parametrize(
    ("alpha", "n", "cycles", "power"),
    [
        (0.05, 100, 40, 0.9),  # z ≈ 4.3 against a bar of 2.2: expected ≈ 0.98
        (0.001, 100, 40, 0.45),  # the default alpha: bar 3.5, expected ≈ 0.75; one cycle is not always enough
        (0.001, 200, 20, 0.9),  # expected ≈ 0.99
    ],
)
def test_a_clear_shift_in_answers_is_detected(alpha, n, cycles, power):
    """0.7/0.3 → 0.4/0.6: the detection rate over simulated cycles, against the two-proportion z power."""
    rng = random.Random(6)
    before, after = {"a": 0.7, "b": 0.3}, {"a": 0.4, "b": 0.6}
    verdicts = [
        compare_samples(
            draws(rng, n, before), draws(rng, n, after), expect=None, alpha=alpha, permutations=3999
        ).verdict
        for _ in range(cycles)
    ]
    assert set(verdicts) <= {Verdict.ANSWER_DRIFT, Verdict.LOGPROB_DRIFT, Verdict.NOISE}
    assert sum(v is Verdict.ANSWER_DRIFT for v in verdicts) >= power * cycles, verdicts


def test_a_falling_correct_rate_is_a_regression_with_its_intervals():
    rng = random.Random(7)
    c = compare_samples(
        draws(rng, 100, {"a": 0.7, "b": 0.3}),
        draws(rng, 100, {"a": 0.4, "b": 0.6}),
        expect=Expect(exact="a"),
        alpha=0.001,
    )
    assert c.verdict is Verdict.REGRESSION
    ev = c.evidence
    assert ev.method == "two-sample-answers" and ev.out and ev.statistic > ev.threshold
    assert ev.p_value <= 0.001 and ev.e_value == pytest.approx(0.5 * ev.p_value**-0.5)
    d = ev.detail
    assert d["n"] == {"baseline": 100, "current": 100, "failed": 0}
    assert d["answers"]["p_value"] <= 0.0005
    base, now, diff = d["correct"]["baseline"], d["correct"]["current"], d["correct"]["difference"]
    assert base["interval_95"][0] < base["rate"] < base["interval_95"][1]
    assert now["interval_95"][0] < now["rate"] < now["interval_95"][1]
    assert diff["interval_95"][1] < 0 < base["rate"]
    assert "correct" in c.reasons[1] and "→" in c.reasons[1]


def test_same_answers_moved_logprobs_is_logprob_drift():
    rng = random.Random(8)
    c = compare_samples(
        draws(rng, 50, PROBS), draws(rng, 50, PROBS, shift=-0.5), expect=Expect(exact="yes"), alpha=0.001
    )
    assert c.verdict is Verdict.LOGPROB_DRIFT, c.reasons
    assert c.evidence.method == "two-sample-logprob" and c.evidence.out
    lp = c.evidence.detail["logprob"]
    assert lp["p_value"] <= 0.0005 and lp["interval_95"][1] < 0
    assert c.evidence.detail["answers"]["p_value"] > 0.0005


def test_bit_identical_sets_are_identical_and_a_moved_stack_is_named():
    rng = random.Random(9)
    base = draws(rng, 20, PROBS)
    again = [sample(o.text, o.tokens[0].logprob) for o in reversed(base)]  # same draws, other order
    c = compare_samples(base, again, expect=None, alpha=0.001)
    assert c.verdict is Verdict.IDENTICAL and not c.evidence.out
    moved = [sample(o.text, o.tokens[0].logprob, stack={"engine": "v2"}) for o in base]
    c = compare_samples(base, moved, expect=None, alpha=0.001)
    assert c.verdict is Verdict.STACK_CHANGE
    assert [(f.field, f.before, f.after) for f in c.stack_changes] == [("engine", "v1", "v2")]
    nudged = [*base[:-1], sample(base[-1].text, base[-1].tokens[0].logprob + 1e-6)]
    assert compare_samples(base, nudged, expect=None, alpha=0.001).verdict is Verdict.NOISE


def test_baseline_request_change_and_errors():
    rng = random.Random(10)
    now = draws(rng, 10, PROBS)
    assert compare_samples([], now, expect=None, alpha=0.001).verdict is Verdict.BASELINE
    other = [sample(o.text, o.tokens[0].logprob, request_hash="h2") for o in now]
    c = compare_samples(other, now, expect=None, alpha=0.001)
    assert c.verdict is Verdict.BASELINE and "request changed" in c.reasons[0]
    failed = [Observation("b", "c", "s", T0, {}, "h", error="boom", error_kind=ErrorKind.TIMEOUT)] * 3
    c = compare_samples(now, failed, expect=None, alpha=0.001)
    assert c.verdict is Verdict.ERROR and "all 3 samples failed" in c.reasons[0]


# -- canary files ---------------------------------------------------------------------------------------
def suite_file(tmp_path: Path, decoding: str) -> Path:
    p = tmp_path / "suite.toml"
    p.write_text(
        f'[suite]\nname = "s"\n[[canary]]\nid = "c"\nmessages = [{{ role = "user", content = "hi" }}]\n'
        f"decoding = {{ {decoding} }}\n"
    )
    return p


@pytest.mark.parametrize(
    ("decoding", "message"),
    [
        ("samples = 30", "canary[0] (id 'c').decoding.samples: samples > 1 needs temperature > 0"),
        ("samples = 30, temperature = 0.0", "decoding.samples: samples > 1 needs temperature > 0"),
        ("samples = 0, temperature = 1.0", "decoding.samples: Input should be greater than or equal to 1"),
        ("samples = 1001, temperature = 1.0", "decoding.samples: Input should be less than or equal to 1000"),
        ('seed = "random"', "decoding.seed: Input should be a valid integer"),
    ],
)
def test_bad_sampled_decoding_is_a_one_line_error_naming_the_field(tmp_path, decoding, message):
    path = suite_file(tmp_path, decoding)
    with pytest.raises(InputError) as e:
        load_suite(path)
    assert str(e.value).startswith(f"{path}: ") and message in str(e.value)
    assert "\n" not in str(e.value)


def test_sampled_decoding_parses_and_seed_none_means_unpinned(tmp_path):
    c = load_suite(suite_file(tmp_path, 'samples = 30, temperature = 1.0, seed = "none"')).canaries[0]
    assert (c.decoding.samples, c.decoding.temperature, c.decoding.seed) == (30, 1.0, None)
    assert load_suite(suite_file(tmp_path, "temperature = 0.7")).canaries[0].decoding.samples == 1


# -- the store: the baseline of a sampled canary is a set -------------------------------------------------
def test_judge_samples_baselines_the_first_cycle_and_compares_sets_after(tmp_path):
    """On the real store: cycle 1 makes a baseline set, cycle 2 (same engine) is judged against all of it."""
    from canaryd.canaries import Canary

    canary = Canary(
        id="c",
        messages=[{"role": "user", "content": "hi"}],
        decoding={"temperature": 1.0, "samples": 30, "seed": 0},
        expect={"exact": "yes"},
    )
    store = Store(f"sqlite:///{tmp_path / 'db.sqlite'}", instance="t")
    rng = random.Random(11)

    def cycle(observations: list[Observation]) -> list[tuple[Observation, Comparison, int | None]]:
        # sample i carries its own request (seed + i), as the sampled shape sends it
        for i, o in enumerate(observations):
            o.request_hash, o.request, o.request_ref = f"h{i}", {"seed": i}, canonical_digest({"seed": i})
        observations[3] = Observation(
            "b", "c", "s", T0, {"seed": 3}, "h3", error="x", error_kind=ErrorKind.HTTP_5XX
        )
        judged = [
            (j.observation, j.comparison, j.baseline_id)
            for j in SAMPLED.judge(store, CompareConfig(alpha=0.001), canary, observations)
        ]
        run = store.start_run("b")
        for obs, comparison, baseline_id in judged:
            store.add_observation(run, obs, comparison, baseline_id)
        return judged

    first = cycle(draws(rng, 30, PROBS))
    verdicts = [c.verdict for _, c, _ in first]
    assert verdicts[3] is Verdict.ERROR
    assert set(verdicts[:3] + verdicts[4:]) == {Verdict.BASELINE}
    assert [c.correct for o, c, _ in first if o.ok] == [o.text == "yes" for o, _, _ in first if o.ok]

    base_id = store.baseline("b", "c").observation_id
    assert [o.request_hash for o in store.run_set(base_id)] == [f"h{i}" for i in range(30)]

    second = cycle(draws(rng, 30, PROBS))
    ok = [(c, b) for o, c, b in second if o.ok]
    assert {c.verdict for c, _ in ok} == {Verdict.NOISE} and {b for _, b in ok} == {base_id}
    ev = ok[0][0].evidence
    assert ev.detail["n"] == {"baseline": 29, "current": 29, "failed": 1}
    assert ev.detail["correct"]["baseline"]["n"] == 29

    # `canaryd check`'s table: the draws share a row, split only by the failed one
    rows = results_table([Result(i, 0, o, c) for i, (o, c, _) in enumerate(second)]).columns
    assert list(rows[1].cells) == ["c ×3", "c", "c ×26"]
    assert list(rows[2].cells)[1].endswith("error[/]")
    hits = [c.correct for _, c, _ in second]
    assert list(rows[3].cells) == [f"{sum(hits[:3])}/3", "-", f"{sum(hits[4:])}/26"]
    store.close()
