"""Intervals a reviewer accepts for the detection bench: bootstrap confidence intervals on a ROC AUC and on
the difference of two methods' AUCs (paired over trials), Clopper–Pearson bounds on a false-alarm rate,
and the rule that a difference inside its interval is a tie.

Scores are ranked once over everything a comparison sees (floats or tuples compared in order, as
`peers.roc_auc` takes them); each bootstrap resample then costs a bincount and a gather, so a thousand
resamples of a few thousand trials take milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

LEVEL = 0.95  # two-sided confidence of every interval the bench prints
RESAMPLES = 1000


@dataclass(frozen=True, slots=True)
class Interval:
    value: float
    low: float
    high: float

    def __format__(self, spec: str) -> str:
        """``+`` signs the figures (a difference); otherwise three decimals."""
        f = "+.3f" if spec == "+" else ".3f"
        return f"{self.value:{f}} [{self.low:{f}}, {self.high:{f}}]"

    def __str__(self) -> str:
        return format(self, "")


def ranks(*groups: Sequence) -> list[np.ndarray]:
    """Each group's scores as dense integer ranks over the union of all groups (equal scores, equal rank)."""
    union = sorted({s for g in groups for s in g})
    index = {s: i for i, s in enumerate(union)}
    return [np.array([index[s] for s in g], dtype=np.int64) for g in groups]


def _auc(pos: np.ndarray, neg: np.ndarray, size: int) -> np.ndarray:
    """P(pos > neg) + ½·P(pos = neg) from dense ranks below ``size``, for each row of the (resamples ×
    trials) index arrays at once (a 1-D pair gives a 0-D result)."""
    pos, neg = np.atleast_2d(pos), np.atleast_2d(neg)
    rows = np.arange(len(neg))[:, None] * size
    counts = np.bincount((neg + rows).ravel(), minlength=len(neg) * size).reshape(len(neg), size)
    below = np.cumsum(counts, axis=1) - counts
    wins = np.take_along_axis(below, pos, axis=1) + 0.5 * np.take_along_axis(counts, pos, axis=1)
    return wins.sum(axis=1) / (pos.shape[1] * neg.shape[1])


def _draw(x: np.ndarray, resamples: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Bootstrap index rows and the values they pick."""
    idx = rng.integers(0, len(x), (resamples, len(x)))
    return idx, x[idx]


def _percentiles(draws: np.ndarray, level: float) -> tuple[float, float]:
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(draws, [tail, 100 - tail])
    return float(low), float(high)


def auc_interval(
    positives: Sequence,
    negatives: Sequence,
    *,
    rng: np.random.Generator,
    resamples: int = RESAMPLES,
    level: float = LEVEL,
) -> Interval:
    """The AUC and its percentile bootstrap interval, positives and negatives resampled separately (the
    trials of a changed server and of an honest one are independent draws)."""
    if not positives or not negatives:
        return Interval(math.nan, math.nan, math.nan)
    pos, neg = ranks(positives, negatives)
    size = int(max(pos.max(), neg.max())) + 1
    draws = _auc(_draw(pos, resamples, rng)[1], _draw(neg, resamples, rng)[1], size)
    return Interval(float(_auc(pos, neg, size)[0]), *_percentiles(draws, level))


def auc_difference(
    a: tuple[Sequence, Sequence],
    b: tuple[Sequence, Sequence],
    *,
    rng: np.random.Generator,
    resamples: int = RESAMPLES,
    level: float = LEVEL,
) -> Interval:
    """AUC(a) − AUC(b), each (positives, negatives), with a paired bootstrap interval: where both methods ran
    the same trials (the same count on each side, trial i of one beside trial i of the other: the same
    server, and under the shim the same simulated day), one draw of trial indices resamples both, so what
    the trials share cancels; otherwise each side is resampled on its own."""
    (pa, na), (pb, nb) = a, b
    if not (pa and na and pb and nb):
        return Interval(math.nan, math.nan, math.nan)
    ra = ranks(pa, na)
    rb = ranks(pb, nb)
    sa = int(max(x.max() for x in ra)) + 1
    sb = int(max(x.max() for x in rb)) + 1
    ip, i_n = _draw(ra[0], resamples, rng)[0], _draw(ra[1], resamples, rng)[0]
    if len(pa) == len(pb) and len(na) == len(nb):
        jp, j_n = ip, i_n
    else:
        jp, j_n = _draw(rb[0], resamples, rng)[0], _draw(rb[1], resamples, rng)[0]
    draws = _auc(ra[0][ip], ra[1][i_n], sa) - _auc(rb[0][jp], rb[1][j_n], sb)
    value = float(_auc(ra[0], ra[1], sa)[0] - _auc(rb[0], rb[1], sb)[0])
    return Interval(value, *_percentiles(draws, level))


def verdict(diff: Interval, margin: float = 0.0) -> str:
    """How a difference (ours − theirs) reads: 'ahead' when its interval lies above ``margin``, 'behind'
    when below −``margin``, otherwise 'tie' (a difference smaller than its interval claims nothing)."""
    if math.isnan(diff.value):
        return "n/a"
    if diff.low > margin:
        return "ahead"
    if diff.high < -margin:
        return "behind"
    return "tie"


def _binom_cdf(k: int, n: int, p: float) -> float:
    """P(X ≤ k) for X ~ Binomial(n, p), summed in log space (n up to many thousands)."""
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 1.0 if k >= n else 0.0
    lp, lq = math.log(p), math.log1p(-p)
    terms = [
        math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq
        for i in range(k + 1)
    ]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def _solve(f, target: float) -> float:
    """The p in [0, 1] where the decreasing f(p) crosses target (bisection to 1e-12)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if f(mid) > target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def clopper_pearson(hits: int, n: int, level: float = LEVEL) -> tuple[float, float]:
    """The exact (Clopper–Pearson) two-sided interval of a rate seen as hits of n trials."""
    if n < 1 or not 0 <= hits <= n:
        raise ValueError(f"clopper_pearson: need 0 ≤ hits ≤ n and n ≥ 1, got {hits} of {n}")
    tail = (1 - level) / 2
    # low: P(X ≥ hits) = tail, i.e. P(X ≤ hits − 1) = 1 − tail; high: P(X ≤ hits) = tail
    low = 0.0 if hits == 0 else _solve(lambda p: _binom_cdf(hits - 1, n, p), 1 - tail)
    high = 1.0 if hits == n else _solve(lambda p: _binom_cdf(hits, n, p), tail)
    return low, high


def rate(hits: int, n: int, level: float = LEVEL) -> str:
    """'hits/n (≤ upper bound)' as the false-alarm columns print it."""
    _, high = clopper_pearson(hits, n, level)
    return f"{hits}/{n} (≤ {high:.3f})"
