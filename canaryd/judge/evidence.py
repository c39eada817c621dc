"""What every judge hands back and combines: `Evidence`, and the conformal rules it is made with.

The noise model (`canaryd.judge.stats`), the calibrated signals (`canaryd.judge.signals`) and the sampled
canaries' two-sample tests (`canaryd.judge.sampled`) all score against the same guard band, turn p-values
into e-values with the same calibrator and combine e-values by the same mean; kept here, below all three,
so each can use them without importing another (see ``stats`` for why these rules).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

S_FLOOR = 1e-6  # nats: below the float32 resolution of a logprob's magnitude, so only real change counts
GUARD = 0.2  # the margin over the largest honest leave-one-out distance
KAPPA = 0.5  # p-to-e calibrator: e = κ·p^(κ−1); bounded by 0.5·√(K+1) per canary


@dataclass(frozen=True, slots=True)
class Evidence:
    """The statistical decision behind a verdict: what was measured, the bar it had to clear, and how
    surprising it is under the calibrated noise (a p-value, and the same as an e-value for combining
    evidence across canaries and cycles)."""

    method: str  # how the statistic was computed, e.g. "exact", "conformal-nn", "two-sample"
    statistic: float
    threshold: float
    p_value: float | None = None
    e_value: float | None = None
    detail: dict = field(default_factory=dict)  # method-specific figures (rates, intervals, counts)
    basis: str = "logprobs"  # "text": the answers compared carried no logprobs (text, usage and stack only)

    @property
    def out(self) -> bool:
        """True when the statistic clears its threshold: the change is more than noise."""
        return self.statistic > self.threshold

    def as_dict(self) -> dict:
        return {
            "method": self.method,
            "statistic": self.statistic,
            "threshold": self.threshold,
            "p_value": self.p_value,
            "e_value": self.e_value,
            "out": self.out,
            "basis": self.basis,
            **({"detail": self.detail} if self.detail else {}),
        }


def robust_spread(values: Sequence[float]) -> float:
    """max(1.4826·MAD, range/4, S_FLOOR): the MAD for a bulk, the range for a few discrete modes."""
    med = statistics.median(values)
    mad = statistics.median(abs(v - med) for v in values)
    return max(1.4826 * mad, (max(values) - min(values)) / 4, S_FLOOR)


def p_to_e(p: float) -> float:
    """The κ-calibrator: a valid e-value from a valid p-value."""
    return KAPPA * p ** (KAPPA - 1)


def cycle_evalue(evalues: Sequence[float]) -> float:
    """Mean of e-values: an e-value under any dependence between canaries (Vovk & Wang 2021)."""
    return sum(evalues) / len(evalues)
