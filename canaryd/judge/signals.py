"""Calibrated signals beyond logprobs: a canary's hidden reasoning tokens and its latency.

The K probes of ``baseline calibrate`` (`canaryd.judge.stats`) also give each canary's spread of two
numbers every answer carries, with or without logprobs: its hidden reasoning tokens
(``usage.completion_tokens_details.reasoning_tokens``) and its latency. Each is scored by the same split
conformal rule on its own: ``D = |x − median| / s`` with ``s`` the robust spread of the K values (floored:
half a token; 5% of latency), the leave-one-out ``D_i`` of each probe against the other K − 1, ``p = (1 +
#{D_i ≥ D}) / (K + 1)``, out beyond ``(1 + GUARD)·max D_i``. K identical reasoning counts are the EXACT
regime (a deterministic engine: any change counts). Reasoning tokens are what a provider silently
lowering its reasoning effort moves (900 → 300 at the same answer).

Latency gets a higher bar, because it measures the path to the engine (network, queueing, neighbours'
load) far more than the engine: it is taken in log seconds (delays multiply), it is out only when it is
also at least ``LATENCY_RATIO`` times (or 1/``LATENCY_RATIO``) the calibrated median and ``LATENCY_MIN_S``
away from it (a loopback's milliseconds jitter by multiples), it is never EXACT, and it is never compared
at all without a calibration. It stays its own signal (``Comparison.latency``): out alone it changes no
verdict; only when enough canaries of a backend are out on latency in one cycle (``max(2, m)``, m as for
the fast path in `canaryd.judge.stats`) are they a ``stack-change`` (`compare.latency_shift`). It never
feeds the e-CUSUM, so a slow network for an hour cannot add up to an alarm.

Each canary's other signals (its logprob or text point, its reasoning tokens) are one comparison: the
deciding signal is the out one with the smallest p-value, the p-value is Bonferroni's ``min(1, m·p)``, the
e-value the mean of the m e-values, and the out bound ``m/(K+1)`` (a union bound).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from canaryd.judge.evidence import GUARD, Evidence, cycle_evalue, p_to_e, robust_spread
from canaryd.observation import Observation

LATENCY_RATIO = 1.5  # a latency signal is out only this many times slower (or faster) than calibrated ...
LATENCY_MIN_S = 0.5  # ... and this many seconds
SIGNAL_FLOOR = {"reasoning_tokens": 0.5, "latency_s": math.log(1.05)}  # spread floors: half a token, 5%


def signal_value(obs: Observation, name: str) -> float | None:
    """The observation's value of a calibrated signal (latency in log seconds), None when it has none."""
    if name == "reasoning_tokens":
        return None if obs.reasoning_tokens is None else float(obs.reasoning_tokens)
    return math.log(obs.latency_s) if obs.latency_s > 0 else None


def _nonconformity(x: float, values: Sequence[float], floor: float) -> float:
    return abs(x - statistics.median(values)) / max(robust_spread(values), floor)


@dataclass(frozen=True, slots=True)
class SignalFit:
    """The calibrated spread of one non-logprob signal of a canary (see the module docstring)."""

    name: str
    values: tuple[float, ...]  # the K probes' values (latency: log seconds)
    loo: tuple[float, ...] = field(init=False)
    # of the values, once: a model judges every probe of its canary with them
    exact: bool = field(init=False, repr=False, compare=False)
    median: float = field(init=False, repr=False, compare=False)
    spread: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        floor = SIGNAL_FLOOR[self.name]
        rest = [self.values[:i] + self.values[i + 1 :] for i in range(len(self.values))]
        loo = tuple(_nonconformity(v, r, floor) for v, r in zip(self.values, rest, strict=True))
        object.__setattr__(self, "loo", loo)
        object.__setattr__(self, "exact", self.name != "latency_s" and len(set(self.values)) == 1)
        object.__setattr__(self, "median", statistics.median(self.values))
        object.__setattr__(self, "spread", max(robust_spread(self.values), floor))

    @property
    def median_s(self) -> float:
        """The median in its own unit (latency: seconds, not log seconds)."""
        return math.exp(self.median) if self.name == "latency_s" else self.median

    def threshold(self, x: float) -> float:
        """The bar ``D`` must clear: beyond every honest leave-one-out value; for latency also a real
        change in seconds, ``LATENCY_RATIO`` times and ``LATENCY_MIN_S`` either way of the median (so
        the jitter of a millisecond round trip is never a finding)."""
        if self.exact:
            return 0.0
        bar = (1 + GUARD) * max(self.loo)
        if self.name == "latency_s":
            m = self.median_s
            need = (
                math.log(m + LATENCY_MIN_S) - self.median
                if x >= self.median
                else (self.median - math.log(max(m - LATENCY_MIN_S, 1e-3)))
            )
            bar = max(bar, max(math.log(LATENCY_RATIO), need) / self.spread)
        return bar

    def score(self, x: float) -> Evidence:
        d = abs(x - self.median) / self.spread
        p = (1 + sum(1 for v in self.loo if v >= d)) / (len(self.values) + 1)
        show = math.exp if self.name == "latency_s" else float
        return Evidence(
            method="exact" if self.exact else "conformal-nn",
            statistic=d,
            threshold=self.threshold(x),
            p_value=p,
            e_value=p_to_e(p),
            detail={
                "signal": self.name,
                "k": len(self.values),
                "value": show(x),
                "calibrated_median": show(self.median),
                "calibrated_range": [show(min(self.values)), show(max(self.values))],
            },
        )

    def summary(self) -> dict:
        show = math.exp if self.name == "latency_s" else float
        return {"median": show(self.median), "min": show(min(self.values)), "max": show(max(self.values))}


def score_signals(
    fits: Mapping[str, SignalFit], obs: Observation, names: Sequence[str] | None = None
) -> list[Evidence]:
    """``obs`` scored on each calibrated non-logprob signal it carries (``fits``: a noise model's
    ``signals``; ``names``: only these)."""
    out = []
    for name, fit in fits.items():
        if (names is None or name in names) and (x := signal_value(obs, name)) is not None:
            out.append(fit.score(x))
    return out


def combine(evidence: Sequence[Evidence]) -> Evidence:
    """One canary's evidence from its m scored signals: the deciding one (the out one with the smallest
    p-value, else the smallest p-value), Bonferroni's p = min(1, m·p), the mean e-value, and every signal's
    figures under ``detail.signals``."""
    if len(evidence) == 1:
        return evidence[0]
    deciding = min(evidence, key=lambda ev: (not ev.out, ev.p_value if ev.p_value is not None else 1.0))
    p = None if deciding.p_value is None else min(1.0, len(evidence) * deciding.p_value)
    e = cycle_evalue([ev.e_value for ev in evidence if ev.e_value is not None])
    signals = {ev.detail.get("signal", "answer"): ev.as_dict() for ev in evidence}
    detail = {**deciding.detail, "k": min(ev.detail["k"] for ev in evidence), "signals_scored": len(evidence)}
    return Evidence(
        deciding.method, deciding.statistic, deciding.threshold, p, e, {**detail, "signals": signals}
    )
