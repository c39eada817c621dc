"""``canaryd baseline calibrate``: measure each canary's honest noise so comparisons can tell it from change.

Each canary is sent K times through its backend, split over the configured load levels: alone, and inside
batches crowded with filler requests (``census.collect``), because batched engines choose numerical paths
by batch shape. `stats.fit` turns the K probes into the canary's noise model, which the store keeps and
every later comparison uses. A chained canary is run K times in sequence (its steps depend on each
other's outputs) and each step gets its own model; sampled canaries need none (their comparison is a
two-sample test). Calibrating restarts the backend's e-CUSUM detector.

A calibration must not launder a change: when the canary's baseline lies outside the noise just measured,
the stack moved since the baseline, and that model is not saved (accept the new baseline first, or
investigate).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from canaryd.backends import Backend
from canaryd.canaries import Canary
from canaryd.judge.stats import CalibrationError, NoiseModel, fit, score
from canaryd.probe.shapes import shape_of
from canaryd.store import Store


@dataclass(frozen=True, slots=True)
class Calibrated:
    """The outcome for one canary (or chain step) × backend."""

    backend: str
    canary_id: str
    model: NoiseModel | None
    errors: int
    problem: str | None = None  # why nothing was saved

    @property
    def unavailable(self) -> bool:
        """Nothing to fit because the backend failed the probes (not because the stack moved)."""
        return self.model is None and self.errors > 0

    def as_dict(self) -> dict:
        return {
            "backend": self.backend,
            "canary": self.canary_id,
            "saved": self.problem is None,
            "problem": self.problem,
            "errors": self.errors,
            **(self.model.summary() if self.model else {}),
        }


def calibrate(
    backend: Backend,
    canaries: Sequence[Canary],
    store: Store,
    *,
    k: int,
    batch_sizes: Sequence[int],
    others: Sequence[Canary] | None = None,
) -> list[Calibrated]:
    """Calibrate every non-sampled canary of one backend and save the models that pass the checks.
    Fillers for the crowded batches come from ``others`` (the backend's whole suite; default ``canaries``)."""
    out = []
    crowd = canaries if others is None else others
    for canary in canaries:
        shape = shape_of(canary)
        if not shape.calibrated:
            continue
        probes = shape.calibration_probes(backend, canary, crowd, k=k, batch_sizes=batch_sizes)
        for cid, observed in probes.items():
            errors = sum(not o.ok for o in observed)
            try:
                model = fit(observed)
            except CalibrationError as e:
                out.append(Calibrated(backend.name, cid, None, errors, str(e)))
                continue
            problem = None
            base = store.baseline(backend.name, cid)
            if base is not None and base[1].request_hash == model.request_hash:
                ev = score(model, base[1])
                if ev.out:
                    problem = (
                        f"the baseline lies outside the noise just measured (D {ev.statistic:.3g} > "
                        f"{ev.threshold:.3g}, max |Δ logprob| {ev.detail['max_abs_dlogprob']:.3g}): the "
                        "stack moved since the baseline; `baseline accept` it first, or investigate"
                    )
            if problem is None:
                store.save_calibration(backend.name, cid, model)
            out.append(Calibrated(backend.name, cid, model, errors, problem))
    return out
