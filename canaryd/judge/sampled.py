"""Sampled canaries: n draws at temperature > 0, compared with the baseline's n draws as distributions.

A canary with ``decoding.samples = n > 1`` sends n requests per cycle (sample i with seed ``seed + i``,
or with no seed when ``seed = "none"``). One draw at temperature > 0 says nothing; n draws estimate a
distribution, and two such estimates are compared with two-sample tests whose false-alarm rate is known:

* **Answers** (`answer_test`): each sample's text, stripped of surrounding whitespace, is one categorical
  answer. The statistic is the total-variation distance between the two empirical answer distributions
  (half the L1 distance: the share of probability mass that moved, in [0, 1]). Its p-value comes from a
  permutation test (fixed-seed RNG, B permutations, ``p = (1 + #{T_perm ≥ T}) / (B + 1)``), exact in
  finite samples and free of the small-count trouble of a chi-square test: sampled answers have a long
  tail of rare strings.
* **Logprobs** (`logprob_test`): each sample's mean chosen-token logprob (nats per token), compared
  *within identical completions*: the statistic is the weighted mean, over completions drawn on both
  sides, of |mean now − mean baseline|, with a permutation p-value (labels shuffled within each
  completion); the signed shift is reported with a stratified bootstrap 95% interval. Why within
  completions: a sample's logprob is mostly set by *which* answer it drew, so a plain difference of means
  would carry the answer mix's variance (drowning a real shift) and re-test what the answer test already
  tests; within one completion the context is identical, so what is left is the engine's confidence: the
  silent shift (same tokens, other logprobs), caught in one cycle on a deterministic engine and against
  batch noise on others. Permutation rather than Mann–Whitney: exact under "same engine" whatever the
  shape of the values, meaningful with the heavy ties of a deterministic engine (where Mann–Whitney's
  normal approximation fails in the 1e-4 tail that matters here), and a shift in nats reads directly.
  Completions drawn on one side only carry no comparable logprob and are left out (the counts used are
  reported); a free-text canary whose every completion is unique has only the answer test.
* **Correctness** (with ``expect``): the share of correct samples per side with a Wilson score interval,
  and the change (now − baseline) with Newcombe's hybrid score interval. Intervals are 95%, for reading;
  the decisions come from the tests.

**Decision.** Two tests share the false-alarm budget ``alpha`` (``[compare] alpha``) by Bonferroni: each
rejects at ``alpha / 2``, so an unchanged engine draws a statistical drift verdict with probability
≤ ``alpha`` per comparison, whatever the dependence between the tests (``stack-change`` is a recorded
fact, not a test). Verdicts, first that applies:

``error``          every current sample failed (failed samples of a partly failed cycle are ``error``
                   observations of their own; the rest are judged).
``baseline``       no baseline set, or sample 0's request differs from the baseline set's sample 0.
``identical``      both sets hold the same (text, tokens, logprobs) draws (a stack change: ``stack-change``).
``regression``     the correct rate fell: Newcombe interval of (now − baseline) entirely below 0, *and*
                   the answer test rejects (so never more false alarms than the answer test).
``answer-drift``   the answer test rejects at alpha / 2.
``logprob-drift``  the answers do not reject, the logprob test does.
``stack-change``   neither rejects, but the serving stack changed.
``within-noise``   neither rejects: whatever moved is within sampling noise.

The `Evidence` names the deciding test (answers, unless only the logprob test rejects or its p-value is the
smaller), its statistic and the critical value it had to exceed (statistic > threshold ⇔ p ≤ alpha / 2),
the Bonferroni-adjusted p-value ``min(1, 2·min(p_answers, p_logprob))`` and the e-value ``κ·p^(κ−1)``
(κ = 0.5, `canaryd.judge.evidence.p_to_e`), so a sampled canary's evidence combines with the rest of canaryd.

**Without logprobs** (a backend that returns none, on either side): the answer test and the correctness
intervals run on the text alone, the logprob test has nothing to compare (its p-value is 1), and the
comparison's basis is ``text``.

Changing only n keeps the baseline: ``samples`` is not a request field (the request hash covers what the
server sees, seed + i included, and sample 0 carries the canary's own seed), the tests accept unequal n, and
raising n for more power should not throw the history away. ``canaryd baseline accept`` re-baselines.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from canaryd.canaries import Expect
from canaryd.judge.compare import Comparison, Evidence, Verdict, basis_of
from canaryd.judge.evidence import p_to_e
from canaryd.observation import Observation, tokens_problem
from canaryd.stack import merge_stacks, split

Z95 = 1.959963984540054  # two-sided 95% normal quantile
SEED = 20260  # the permutation/bootstrap RNG's seed: the same draws always give the same p-values
BOOTSTRAP = 4000  # resamples for the logprob difference's interval
_CELLS = 4_000_000  # integers per chunk of permutations (memory bound: ~32 MB)


# -- intervals ------------------------------------------------------------------------------------------
def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a rate k/n: good coverage at small n and near 0 or 1, unlike Wald's."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return (0.0 if k == 0 else centre - half, 1.0 if k == n else centre + half)  # exact at the edges


def newcombe(k1: int, n1: int, k0: int, n0: int, z: float = Z95) -> tuple[float, float]:
    """Newcombe's hybrid score interval (his method 10) for the difference of rates k1/n1 − k0/n0.

    Built from the two Wilson intervals, so it inherits their behaviour at small n and extreme rates.
    """
    p1, p0 = (k1 / n1 if n1 else 0.0), (k0 / n0 if n0 else 0.0)
    l1, u1 = wilson(k1, n1, z)
    l0, u0 = wilson(k0, n0, z)
    d = p1 - p0
    return (d - math.sqrt((p1 - l1) ** 2 + (u0 - p0) ** 2), d + math.sqrt((u1 - p1) ** 2 + (p0 - l0) ** 2))


# -- two-sample tests -----------------------------------------------------------------------------------
def permutations_for(level: float) -> int:
    """B such that a p-value can reach a tenth of ``level`` (about ten permuted values beyond the bar)."""
    return max(9999, math.ceil(10 / level) - 1)


@dataclass(frozen=True, slots=True)
class TwoSampleTest:
    """One permutation test. ``statistic > threshold`` exactly when ``p_value <= level``."""

    statistic: float
    threshold: float  # the critical value at ``level``, from the permutation distribution
    p_value: float
    level: float
    permutations: int

    @property
    def reject(self) -> bool:
        return self.statistic > self.threshold


def _permutation_test(
    observed: float,
    permuted: Callable[[np.random.Generator, int], np.ndarray],
    width: int,
    *,
    level: float,
    permutations: int | None,
    eps: float = 0.0,
) -> tuple[float, float, int]:
    """(critical value, p-value, B) of ``observed`` against B random relabellings.

    ``permuted(rng, rows)`` draws ``rows`` relabellings of ``width`` values and returns their statistics.
    ``eps`` counts permuted values within rounding of the observed one as ties (conservative).
    """
    b = permutations or permutations_for(level)
    m = math.floor(level * (b + 1)) - 1  # reject ⇔ #{T_perm ≥ T} ≤ m ⇔ p ≤ level
    if m < 0:
        raise ValueError(f"{b} permutations cannot reach p ≤ {level:g}")
    rng = np.random.default_rng(SEED)
    chunk = max(1, _CELLS // max(1, width))
    perm = np.concatenate([permuted(rng, min(chunk, b - start)) for start in range(0, b, chunk)])
    critical = float(-np.partition(-perm, m)[m]) + eps  # the (m+1)-th largest permuted value
    p = (1 + int(np.count_nonzero(perm >= observed - eps))) / (b + 1)
    return critical, p, b


def answer_test(
    baseline: Sequence[str], current: Sequence[str], *, level: float, permutations: int | None = None
) -> TwoSampleTest:
    """Total-variation distance between the empirical answer distributions, with its permutation p-value.

    Computed on integer counts (2·n0·n1·TV = Σ|c1·n0 − c0·n1|), so ties with the observed value are exact.
    """
    n0, n1 = len(baseline), len(current)
    codes = {a: i for i, a in enumerate(dict.fromkeys([*baseline, *current]))}
    k = len(codes)
    pooled = np.array([codes[a] for a in [*baseline, *current]], dtype=np.int64)
    total = np.bincount(pooled, minlength=k)

    def stat(cur: np.ndarray) -> np.ndarray:
        rows = len(cur)
        counts = np.bincount((cur + k * np.arange(rows)[:, None]).ravel(), minlength=rows * k)
        counts = counts.reshape(rows, k)
        return np.abs(counts * n0 - (total - counts) * n1).sum(axis=1)

    def permuted(rng: np.random.Generator, rows: int) -> np.ndarray:
        return stat(rng.permuted(np.tile(pooled, (rows, 1)), axis=1)[:, n0:])

    observed = float(stat(pooled[None, n0:])[0])
    critical, p, b = _permutation_test(
        observed, permuted, len(pooled), level=level, permutations=permutations
    )
    scale = 2 * n0 * n1
    return TwoSampleTest(observed / scale, critical / scale, p, level, b)


@dataclass(frozen=True, slots=True)
class LogprobTest:
    """Mean chosen-token logprob per sample, baseline vs now, within identical completions.

    ``test.statistic`` is the mean |shift| over the completions drawn on both sides; ``difference`` is
    the signed mean shift, for direction, with its interval (None when no completion is shared).
    """

    test: TwoSampleTest
    mean_baseline: float | None  # weighted over the shared completions
    mean_current: float | None
    difference: float | None  # now − baseline, nats per token
    interval: tuple[float, float] | None  # stratified bootstrap 95% percentile interval of the difference
    shared: int  # completions drawn on both sides (the strata)
    samples: tuple[int, int]  # samples in those strata, baseline and now


def logprob_test(
    baseline: Sequence[tuple[Hashable, float]],
    current: Sequence[tuple[Hashable, float]],
    *,
    level: float,
    permutations: int | None = None,
) -> LogprobTest:
    """Within-completion shift of (completion, value) samples: permutation p-value, bootstrap interval.

    For each completion s drawn on both sides, δ_s = mean_now_s − mean_base_s. The statistic is
    Σ w_s |δ_s| with w_s ∝ n0_s·n1_s / (n0_s + n1_s) (the precision weights of a stratified comparison, as
    in van Elteren's test): absolute, because a weight change moves different completions in different
    directions and a signed mean lets them cancel. Relabellings permute within each completion, which is
    exact under "same engine" whatever the spread within a completion (zero on a deterministic engine,
    batch noise on others).
    """
    groups: dict[Hashable, tuple[list[float], list[float]]] = {}
    for side, draws in enumerate((baseline, current)):
        for key, value in draws:
            groups.setdefault(key, ([], []))[side].append(value)
    strata = [(np.array(b), np.array(c)) for b, c in groups.values() if b and c]
    if not strata:  # no completion on both sides: nothing comparable, no evidence either way
        return LogprobTest(TwoSampleTest(0.0, 0.0, 1.0, level, 0), None, None, None, None, 0, (0, 0))
    w = np.array([len(b) * len(c) / (len(b) + len(c)) for b, c in strata])
    w /= w.sum()
    values = np.concatenate([np.concatenate([b, c]) for b, c in strata])
    sizes = np.array([len(b) + len(c) for b, c in strata])
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    block = np.repeat(np.arange(len(strata), dtype=float), sizes)
    # slot weights: −1/n0_s on a stratum's baseline slots, +1/n1_s on its current ones, so that the
    # per-stratum sums of values·coef are the δ_s
    coef = np.concatenate(
        [np.concatenate([np.full(len(b), -1 / len(b)), np.full(len(c), 1 / len(c))]) for b, c in strata]
    )

    def shift(rows: np.ndarray) -> np.ndarray:
        return np.abs(np.add.reduceat(rows * coef, starts, axis=1)) @ w

    def permuted(rng: np.random.Generator, rows: int) -> np.ndarray:
        order = np.argsort(block + rng.random((rows, len(values))), axis=1)  # shuffles within each block
        return shift(values[order])

    observed = float(shift(values[None, :])[0])
    eps = 1e-9 * (1.0 + float(np.abs(values).max()))
    critical, p, b = _permutation_test(
        observed, permuted, len(values), level=level, permutations=permutations, eps=eps
    )
    rng = np.random.default_rng(SEED + 1)
    boot = sum(
        wi
        * (rng.choice(c, (BOOTSTRAP, len(c))).mean(axis=1) - rng.choice(b, (BOOTSTRAP, len(b))).mean(axis=1))
        for wi, (b, c) in zip(w, strata, strict=True)
    )
    low, high = np.quantile(boot, [0.025, 0.975])
    mean_base = float(sum(wi * b.mean() for wi, (b, _) in zip(w, strata, strict=True)))
    mean_cur = float(sum(wi * c.mean() for wi, (_, c) in zip(w, strata, strict=True)))
    return LogprobTest(
        TwoSampleTest(observed, critical, p, level, b),
        mean_base,
        mean_cur,
        mean_cur - mean_base,
        (float(low), float(high)),
        len(strata),
        (sum(len(b) for b, _ in strata), sum(len(c) for _, c in strata)),
    )


# -- one comparison -------------------------------------------------------------------------------------
def answer(obs: Observation) -> str:
    """A sample's categorical answer: its text without surrounding whitespace."""
    return (obs.text or "").strip()


def completion(obs: Observation) -> tuple:
    """What a sample generated, token by token: samples with equal completions saw equal contexts."""
    return tuple((t.token, t.token_id) for t in obs.tokens)


def mean_logprob(obs: Observation) -> float | None:
    """The sample's mean chosen-token logprob (None without tokens)."""
    return sum(t.logprob for t in obs.tokens) / len(obs.tokens) if obs.tokens else None


def _rate(k: int, n: int) -> dict:
    low, high = wilson(k, n)
    return {"rate": k / n if n else None, "k": k, "n": n, "interval_95": [low, high]}


def _draw(obs: Observation) -> tuple:
    return (obs.text, tuple(obs.tokens))


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def compare_samples(
    baseline: Sequence[Observation],
    current: Sequence[Observation],
    *,
    expect: Expect | None,
    alpha: float,
    permutations: int | None = None,
) -> Comparison:
    """Classify a cycle's samples against the baseline set (see the module docstring for the order).

    ``baseline`` and ``current`` are in sending order (sample 0 first), failed samples included.
    ``correct`` is left None: it is per sample (`judge_samples` fills it in).
    """
    now = [o for o in current if o.ok and tokens_problem(o.tokens) is None]
    if not now:
        last = current[-1] if current else None
        why = f"{last.error_kind}: {last.error}" if last else "no samples"
        return Comparison(
            Verdict.ERROR,
            None,
            reasons=(f"all {len(current)} samples failed ({why})",),
            basis=basis_of(*current),
        )
    base = [o for o in baseline if o.ok]
    if not base:
        return Comparison(
            Verdict.BASELINE,
            None,
            reasons=(f"no baseline yet: these {len(now)} samples become it",),
            basis=basis_of(*now),
        )
    if baseline[0].request_hash != current[0].request_hash:
        return Comparison(
            Verdict.BASELINE,
            None,
            reasons=("canary request changed since the baseline: new baseline",),
            basis=basis_of(*now),
        )
    refused = next(
        (f"sample {i}: {bad}" for i, o in enumerate(base) if (bad := tokens_problem(o.tokens))), None
    )
    if refused is not None:  # stored by a version that did not vet logprobs
        return Comparison(
            Verdict.BASELINE,
            None,
            reasons=(f"stored baseline refused ({refused}): these samples replace it",),
            basis=basis_of(*now),
        )
    basis = basis_of(*base, *now)

    level = alpha / 2  # Bonferroni over the two tests
    answers = answer_test(
        [answer(o) for o in base], [answer(o) for o in now], level=level, permutations=permutations
    )
    lp = logprob_test(
        [(completion(o), v) for o in base if (v := mean_logprob(o)) is not None],
        [(completion(o), v) for o in now if (v := mean_logprob(o)) is not None],
        level=level,
        permutations=permutations,
    )
    changed, recorded = split(merge_stacks(o.stack for o in base), merge_stacks(o.stack for o in now))
    stack_changes = tuple(changed)
    fingerprints = ({o.system_fingerprint for o in base}, {o.system_fingerprint for o in now})

    correct = None
    fell = False
    if expect is not None:
        k0 = sum(expect.check(o.text or "") for o in base)
        k1 = sum(expect.check(o.text or "") for o in now)
        low, high = newcombe(k1, len(now), k0, len(base))
        fell = high < 0
        correct = {
            "baseline": _rate(k0, len(base)),
            "current": _rate(k1, len(now)),
            "difference": {"value": k1 / len(now) - k0 / len(base), "interval_95": [low, high]},
        }

    reasons = []
    if correct is not None:
        c0, c1, d = correct["baseline"], correct["current"], correct["difference"]
        reasons.append(
            f"correct {_pct(c0['rate'])} [{_pct(c0['interval_95'][0])}–{_pct(c0['interval_95'][1])}] → "
            f"{_pct(c1['rate'])} [{_pct(c1['interval_95'][0])}–{_pct(c1['interval_95'][1])}], "
            f"Δ [{100 * d['interval_95'][0]:+.0f}, {100 * d['interval_95'][1]:+.0f}] pts"
        )
    reasons.append(
        f"answers TV {answers.statistic:.3g} (p {answers.p_value:.2g}, bar {answers.threshold:.3g})"
    )
    if basis == "text":
        reasons.append("no logprobs: answers judged on text alone")
    if lp.difference is not None:
        reasons.append(
            f"logprobs of {lp.shared} shared completions moved {lp.test.statistic:.3g} nats/token "
            f"(p {lp.test.p_value:.2g}; signed Δ {lp.difference:+.3g} "
            f"[{lp.interval[0]:+.3g}, {lp.interval[1]:+.3g}])"  # type: ignore[index]
        )
    if stack_changes:
        reasons.append(f"stack changed ({len(stack_changes)} field{'s' if len(stack_changes) > 1 else ''})")

    if Counter(map(_draw, base)) == Counter(map(_draw, now)):
        verdict = Verdict.STACK_CHANGE if stack_changes else Verdict.IDENTICAL
        reasons.insert(0, f"the same {len(now)} draws")
    elif fell and answers.reject:
        verdict = Verdict.REGRESSION
        reasons.insert(0, "correct rate fell")
    elif answers.reject:
        verdict = Verdict.ANSWER_DRIFT
        reasons.insert(0, f"answer distribution moved (p ≤ {level:g})")
    elif lp.test.reject:
        verdict = Verdict.LOGPROB_DRIFT
        reasons.insert(0, f"logprobs moved (p ≤ {level:g}), answers within noise")
    elif stack_changes:
        verdict = Verdict.STACK_CHANGE
    else:
        verdict = Verdict.NOISE
        reasons.insert(0, f"within sampling noise at alpha {alpha:g}")

    deciding, method = (
        (answers, "two-sample-answers")
        if answers.reject or answers.p_value <= lp.test.p_value
        else (lp.test, "two-sample-logprob")
    )
    p = min(1.0, 2 * min(answers.p_value, lp.test.p_value))
    detail = {
        "n": {"baseline": len(base), "current": len(now), "failed": len(current) - len(now)},
        "alpha": alpha,
        "correction": "bonferroni: each test at alpha/2",
        "answers": {
            "tv": answers.statistic,
            "threshold": answers.threshold,
            "p_value": answers.p_value,
            "permutations": answers.permutations,
            "distinct": {
                "baseline": len({answer(o) for o in base}),
                "current": len({answer(o) for o in now}),
            },
        },
        "logprob": {
            "statistic": "mean chosen-token logprob per sample, within identical completions",
            "completions_shared": lp.shared,
            "samples": {"baseline": lp.samples[0], "current": lp.samples[1]},
            "mean_abs_shift": lp.test.statistic,
            "mean_baseline": lp.mean_baseline,
            "mean_current": lp.mean_current,
            "difference": lp.difference,
            "interval_95": list(lp.interval) if lp.interval else None,
            "threshold": lp.test.threshold,
            "p_value": lp.test.p_value,
            "permutations": lp.test.permutations,
        },
        "correct": correct,
    }
    return Comparison(
        verdict=verdict,
        correct=None,
        text_identical=Counter(map(answer, base)) == Counter(map(answer, now)),
        fingerprint_changed=fingerprints[0] != fingerprints[1],
        stack_changes=stack_changes,
        recording_changes=tuple(recorded),
        reasons=tuple(reasons),
        evidence=Evidence(method, deciding.statistic, deciding.threshold, p, p_to_e(p), detail, basis),
        basis=basis,
    )
