"""Calibration that lives: a noise model widens when honest noise grows, and never follows a change.

Pure rules; the probes are sent and the model saved by ``canaryd.probe.living`` (docs/detection.md,
"Calibration that lives"). A model fitted once goes stale when load, fleet size or batch mix changes: the
honest noise grows, every probe lies beyond the K honest ones, and the canary pages for ever. Widening the
model on every out probe would launder a change instead. What tells the two apart is **location**:

* honest noise that grows (a larger sd, a new numerical path taken as the load rises, a fleet member
  added) moves each logprob up or down, around the centre the first model measured: its mean over the
  answer's coordinates stays near 0 whatever its spread;
* a change (a shift, a slow ramp, new weights) moves the logprobs one way: their mean leaves the centre.

**The location statistic** of a probe: over its coordinates aligned with the first model's modal completion,
``z_j = (x_j − c_j)/s_j`` with ``c_j`` the median of the first K probes and ``s_j`` their spread, the
Wilcoxon signed-rank statistic of the z (zeros dropped), over its sd under symmetry, ``W = Σ
sign(z_j)·rank|z_j| / √(n(n+1)(2n+1)/6)``. Ranks make it scale-free (a growth of spread by any factor leaves
it where it was) and robust to the spread's heterogeneity: a shift moves most on the coordinates the first
model measured most precisely, which carry the top ranks, while a mean over z would be swamped by the few
wide ones. Its null is the first K probes' own, each against the centre of the others (leave-one-out); a
probe is *location-quiet* when ``|W| ≤ max(max |W_LOO|, W_FLOOR)``: a conformal bound (``P(moved | honest) ≤
1/(K+1)``), floored at W's own distribution-free null under symmetry (|W| > 2.5: 1.2%), since K probes can
lie closer to their centre by chance than later honest ones, and a bound too tight refuses the refits a
grown noise needs (it pages until one passes). One short answer has few coordinates (a two-token answer with
a top-5: 12, whose |W| cannot exceed 3.06), so the pass's canaries are also taken together as one probe
(`pooled`: ``Σ W / √C`` over the C calibrated answers, held to the largest of their bounds): a change of the
stack moves every canary one way, honest noise each its own way.

**The rule** (`refit`). When the pass is location-quiet (every calibrated answer, and pooled), each
calibrated (not exact) canary out of its noise gets ``refit_probes`` more probes, sent alone as the pass's
own answers are (crowded ones take the crowd's path, and would not sample the noise that judges them);
when every one of them is location-quiet too and none has a completion the first model never gave, the
answer and its probes join the model as references, so a new path or a wider spread is a neighbour from
then on. A refit

* only adds: the first K probes, their spread and their centre stay, so every later probe is still held
  to the centre the canary was first fitted at, and a slow drift accumulates against it instead of
  being followed (its probes fail the location test, whatever the spread);
* is capped: no reference may stand further than ``refit_cap`` times the first model's *reach* from its
  nearest other (references that would are left out), so the threshold never exceeds ``refit_cap`` times
  the reach (and the guard band). The reach (`reach`) is the largest distance from one of the first K
  probes to its nearest distinct other: a continuous model's largest leave-one-out distance, and for a
  modal model whose every path came twice (bit-identical twins, a leave-one-out maximum of 0) the widest
  gap between its paths; measured against 0, every new path's probe would lie beyond the cap, and a
  grown noise on 13 canaries paged for most passes;
* keeps at most K added references (the oldest added go first; the first K never do);
* never moves the baseline, and an exact model is never refit (exactness is its contract).

After a refit the p-value is taken against the added references' leave-one-out distances (the noise as it
is now; `canaryd.judge.stats.score_point`), coarser until more refits add more, so the e-CUSUM does not
climb on p-values measured against the narrower first noise. The out threshold is the one over all
references.

Each refit is counted in the model (`Refit`: count, when, the first K) and in the pass's evidence, so
``canaryd history`` and ``canaryd record`` show it. The detector restarts only when its alarm is on, every
canary out in that cycle was refit and the pass was location-quiet (`restarts_detector`): the alarm that
spread growth raised is cleared, one a change raised is not.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from canaryd.judge.stats import MIN_SUPPORT, Key, NoiseModel, Point, Refit, Regime, common_prefix, distance

if TYPE_CHECKING:
    from canaryd.judge.compare import Comparison

W_FLOOR = 2.5  # |W| beyond it: 1.2% of honest answers under symmetry alone (W's distribution-free null)


@dataclass(frozen=True, slots=True)
class Location:
    """The first model's centre and the bound of the location statistic, derived once per model."""

    centre: dict[Key, float]
    modal: tuple[str, ...]  # the first model's modal completion (its token identity)
    bound: float

    def t(self, model: NoiseModel, x: Point) -> float | None:
        """The probe's signed-rank location against the centre (None: no coordinate to tell by)."""
        return _t(model, self.centre, self.modal, x)


def first_refs(model: NoiseModel) -> tuple[Point, ...]:
    return model.refs[: model.refit.first] if model.refit else model.refs


def _centre(refs: Sequence[Point]) -> dict[Key, float]:
    values: dict[Key, list[float]] = {}
    for r in refs:
        for k, v in r.coords.items():
            values.setdefault(k, []).append(v)
    return {k: statistics.median(v) for k, v in values.items() if len(v) >= MIN_SUPPORT}


def _modal(refs: Sequence[Point]) -> tuple[str, ...]:
    counts: dict[tuple[str, ...], int] = {}
    for r in refs:
        counts[r.ids] = counts.get(r.ids, 0) + 1
    return max(counts, key=counts.__getitem__)


def _t(model: NoiseModel, centre: dict[Key, float], modal: tuple[str, ...], x: Point) -> float | None:
    last = common_prefix(x.ids, modal)
    keys = [k for k in x.coords if k[0] <= last and k in centre]
    if not keys:
        return None
    z = [(x.coords[k] - centre[k]) / model.spread.get(k, model.default_spread) for k in keys]
    z = sorted((v for v in z if v != 0.0), key=abs)
    n = len(z)
    if n == 0:
        return 0.0
    w = sum(math.copysign(rank, v) for rank, v in enumerate(z, 1))
    return w / math.sqrt(n * (n + 1) * (2 * n + 1) / 6)


def location(model: NoiseModel) -> Location:
    """The centre of the model's first K probes and the location bound from their leave-one-out Ws."""
    refs = first_refs(model)
    modal = _modal(refs)
    loo = []
    for i, r in enumerate(refs):
        t = _t(model, _centre(refs[:i] + refs[i + 1 :]), modal, r)
        if t is not None:
            loo.append(abs(t))
    # no probe with a coordinate to rank (a text-only answer): the floor
    return Location(_centre(refs), modal, max([W_FLOOR, *loo]))


def refit(
    model: NoiseModel, probes: Sequence[Point], loc: Location, *, cap: float, at: str
) -> NoiseModel | str:
    """The model with ``probes`` (honest probes of a pass whose canary was out) added as references, or
    why not (the module docstring gives the rule)."""
    if model.regime is Regime.EXACT or model.basis != "logprobs":
        return f"a {model.regime.value} model on {model.basis} is not refit"
    if any(p.completion not in model.completions for p in probes):
        return "a probe gave a completion the model never saw: an answer change, not a wider spread"
    moved = [t for p in probes if (t := loc.t(model, p)) is None or abs(t) > loc.bound]
    if moved or not probes:
        worst = max((abs(t) for t in moved if t is not None), default=math.nan)
        return f"the logprobs moved one way (location |t| {worst:.3g} > {loc.bound:.3g}): a change, not noise"
    first = first_refs(model)
    base = reach(model, first)
    added = [*model.refs[len(first) :], *probes][-len(first) :]
    while True:
        refs = (*first, *added)
        loo = _loo(model, refs)
        keep = [p for p, d in zip(added, loo[len(first) :], strict=True) if d <= cap * base]
        if len(keep) == len(added):
            break
        added = keep
    if not added or not any(p in added for p in probes):
        return (
            f"every probe lies beyond the widening cap ({cap:g}× the first model's reach, its farthest "
            "distinct neighbour)"
        )
    count = model.refit.count + 1 if model.refit else 1
    return NoiseModel(
        model.request_hash,
        refs,
        model.spread,
        model.default_spread,
        tuple(loo),
        model.signal_values,
        Refit(len(first), count, at, model.refit.loo_max if model.refit else max(model.loo)),
    )


def reach(model: NoiseModel, first: Sequence[Point]) -> float:
    """What the widening cap is measured against: the largest distance from one of the first K probes to
    its nearest *distinct* other. For a continuous model it is the largest leave-one-out distance; for a
    modal one whose every path came twice (bit-identical twins: a leave-one-out maximum of 0) it is the
    widest gap between its paths, the noise it showed, where 0 would refuse every new path."""
    gaps = [
        min(
            (
                d
                for j, o in enumerate(first)
                if j != i and (d := distance(r, o, model.spread, model.default_spread)) > 0
            ),
            default=0.0,
        )
        for i, r in enumerate(first)
    ]
    return max(gaps, default=0.0)


def _loo(model: NoiseModel, refs: Sequence[Point]) -> list[float]:
    return [
        min(distance(r, o, model.spread, model.default_spread) for j, o in enumerate(refs) if j != i)
        for i, r in enumerate(refs)
    ]


def due_refits(
    answers: Sequence[tuple[Comparison, NoiseModel, Point]],
    locate: Callable[[NoiseModel], Location] = location,
) -> tuple[bool, list[tuple[int, Location]]]:
    """The rule's first half, before any probe is sent, over a pass's calibrated answers (each with its
    comparison, its configuration's model and its point): whether the pass kept its location (every answer,
    and the answers `pooled`), and the answers due a refit, by index, with their model's location: out of
    their noise, location-quiet, with no stack or prompt change. On a pass that moved, none is due."""
    ts, bounds, quiet, due = [], [], True, []
    for i, (comparison, model, x) in enumerate(answers):
        loc = locate(model)
        if (t := loc.t(model, x)) is None:
            continue
        ts.append(t)
        bounds.append(loc.bound)
        quiet = quiet and abs(t) <= loc.bound
        moved = comparison.stack_changes or comparison.prompt_tokens_changed
        if comparison.evidence is not None and comparison.evidence.out and abs(t) <= loc.bound and not moved:
            due.append((i, loc))
    quiet = quiet and abs(pooled(ts)) <= max(bounds, default=0.0)
    return quiet, due if quiet else []


def pooled(ts: Sequence[float]) -> float:
    """The pass's canaries as one probe: their location statistics summed, over √(how many)."""
    return sum(ts) / math.sqrt(len(ts)) if ts else 0.0


def restarts_detector(alarm: bool, out: Sequence[str], refit_ids: set[str], quiet: bool) -> bool:
    """Whether the pass's refits clear the backend's alarm: it is on, every canary out this cycle was
    refit, and every calibrated canary's own answer was location-quiet (``quiet``)."""
    return alarm and bool(out) and set(out) <= refit_ids and quiet
