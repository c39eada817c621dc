"""Learning by default: a canary × backend × serving configuration without a noise model learns one.

Pure rules over a learning window; the probes are sent and the state kept by ``canaryd.probe.learn``
(docs/detection.md, "Learning by default").

A canary without a noise model is never judged at tolerance 0 unless its backend has shown that it is
exact. First contact sends a few probes (alone, and crowded where the kind allows): all bit-identical
with the pass's own answer, and the backend is exact (an EXACT model, one-probe detection). Otherwise the
canary is *learning*: each pass adds its own answer and a few crowded probes to a window kept in the
``calibration`` table (a row whose model is ``{"learning": ...}``), until ``learn_k`` probes are in and
`canaryd.judge.stats.fit_points` fits the model.

During learning, an answer or logprob that moved is ``learning`` (`hold`), never drift: nothing yet says
how far this backend's honest answers move. What is not noise is reported as before: a changed stack or
prompt token count (``stack-change``), a wrong answer where the baseline was right (``regression``), a
configuration's first answer (``new-configuration``).

A window must not launder a change. A full window whose newest probes (the pass that filled it) lie
outside the noise of the probes before them is *suspect* from there (`newest_within`), and waits until the
probes since then are enough for the scan below to tell them from the rest (`resolvable`). The model is
then saved only when the baseline lies within it (the check ``baseline calibrate`` makes) and the window
holds no change point in time (`window_shift_p`, a permutation scan at ``SHIFT_ALPHA``): a change during
the window splits it in time, where honest noise does not. A window that fails either is discarded and
learning restarts once; a second failure is *refused*: the canary is then judged as without learning
(tolerance 0, drift), with the reason, until ``baseline accept`` or ``baseline calibrate``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from canaryd.judge.compare import Comparison, Evidence, Verdict, basis_of
from canaryd.judge.signals import score_signals
from canaryd.judge.stats import NoiseModel, Point, distance, fit_points, point, score, score_point
from canaryd.observation import Observation

SHIFT_ALPHA = 0.002  # a change point in the window more likely than this by chance: not a change
PERMUTATIONS = 999
MIN_FIT = 3  # the fewest probes a window past ``learn_max_passes`` is fit from

Sample = tuple[float | None, float]  # a probe's reasoning tokens and latency (seconds)


@dataclass(frozen=True, slots=True)
class Learning:
    """One canary × backend × configuration's learning window, as the store keeps it between passes (and
    processes). ``refused``: why learning gave up (the canary is judged as without learning)."""

    request_hash: str
    points: tuple[Point, ...]
    samples: tuple[Sample, ...]  # one per point
    target: int
    passes: int = 0
    restarts: int = 0
    refused: str | None = None
    max_passes: int = 0  # ``learn_max_passes`` when it started (0: none)
    suspect: int | None = None  # where probes out of the noise before them began (`newest_within`)
    texts: tuple[str, ...] = ()  # each point's answer text: its answer distribution (`canaryd.judge.answers`)

    @property
    def k(self) -> int:
        return len(self.points)

    @property
    def progress(self) -> str:
        return f"{self.k}/{self.target}"

    def reason(self) -> str:
        """What a verdict of a learning canary says."""
        if self.refused is not None:
            return f"learning refused: {self.refused}"
        again = ", restarted once" if self.restarts else ""
        late = (
            f"; past learn_max_passes ({self.max_passes}): fitted at the next quiet pass with at least "
            f"{MIN_FIT} probes (its passes keep failing or drifting)"
            if self.max_passes and self.passes >= self.max_passes
            else ""
        )
        return (
            f"learning this canary's noise: {self.progress} probes after {self.passes} "
            f"pass{'es' if self.passes != 1 else ''}{again}{late}"
        )

    def evidence(self) -> Evidence:
        """Progress as evidence (`check --json`, history): no p-value, so no cycle decision reads it."""
        return Evidence(
            method="learning",
            statistic=float(self.k),
            threshold=float(self.target),
            detail={
                "probes": self.k,
                "target": self.target,
                "passes": self.passes,
                "restarts": self.restarts,
            },
        )

    def add(self, observations: Sequence[Observation]) -> Learning:
        """The window with ``observations`` (honest probes of its request) appended."""
        return replace(
            self,
            points=(*self.points, *(point(o) for o in observations)),
            samples=(*self.samples, *(_sample(o) for o in observations)),
            texts=(*self.texts, *(o.text or "" for o in observations)),
        )

    def model(self) -> NoiseModel:
        """The window fitted (`CalibrationError` below 2 probes)."""
        signals: dict[str, tuple[float, ...]] = {}
        reasoning = [r for r, _ in self.samples]
        if all(r is not None for r in reasoning):
            signals["reasoning_tokens"] = tuple(float(r) for r in reasoning)  # type: ignore[arg-type]
        if all(lat > 0 for _, lat in self.samples):
            signals["latency_s"] = tuple(lat for _, lat in self.samples)
        return fit_points(self.request_hash, self.points, signals)

    def as_dict(self) -> dict:
        return {
            "learning": {
                "request_hash": self.request_hash,
                "points": [p.as_list() for p in self.points],
                "samples": [list(s) for s in self.samples],
                "target": self.target,
                "passes": self.passes,
                "restarts": self.restarts,
                "refused": self.refused,
                "max_passes": self.max_passes,
                "suspect": self.suspect,
                "texts": list(self.texts),
            }
        }

    @classmethod
    def start(
        cls, request_hash: str, observations: Sequence[Observation], target: int, max_passes: int = 0
    ) -> Learning:
        """A window begun at first contact (which counts as its first pass) with its probes."""
        return cls(request_hash, (), (), target, passes=1, max_passes=max_passes).add(observations)

    @classmethod
    def from_dict(cls, doc: Mapping) -> Learning:
        """The stored window (KeyError, TypeError or ValueError when it is not one)."""
        w = doc["learning"]
        points = tuple(Point.from_list(p) for p in w["points"])
        samples = tuple((None if r is None else float(r), float(lat)) for r, lat in w["samples"])
        if len(samples) != len(points):
            raise ValueError("learning window: a sample per point")
        refused = w.get("refused")
        return cls(
            str(w["request_hash"]),
            points,
            samples,
            int(w["target"]),
            int(w["passes"]),
            int(w["restarts"]),
            None if refused is None else str(refused),
            int(w.get("max_passes", 0)),
            None if w.get("suspect") is None else int(w["suspect"]),
            tuple(str(t) for t in w.get("texts", ())),  # absent: a window an older version began
        )


def is_learning(doc: Mapping | None) -> bool:
    """Whether a stored calibration is a learning window rather than a noise model."""
    return doc is not None and "learning" in doc


def _sample(obs: Observation) -> Sample:
    return (None if obs.reasoning_tokens is None else float(obs.reasoning_tokens), obs.latency_s)


def exact(observations: Sequence[Observation]) -> bool:
    """All bit-identical (tokens and every logprob, top-k included): the backend showed it is exact."""
    return len({point(o).signature for o in observations}) == 1


def hold(c: Comparison, state: Learning | None) -> Comparison:
    """A comparison made without a noise model, while the canary learns one: an answer or logprob that
    moved is ``learning``; a stack or prompt that moved with it is still ``stack-change``; a regression, an
    error and the quiet verdicts stand. ``state`` None: first contact has not yet decided the regime."""
    why = state.reason() if state is not None else "learning: first contact decides whether it is exact"
    if c.verdict in (Verdict.ERROR, Verdict.BASELINE, Verdict.NEW_CONFIG):
        return c
    if c.verdict not in (Verdict.LOGPROB_DRIFT, Verdict.ANSWER_DRIFT):
        return replace(c, reasons=(*c.reasons, why))
    moved = c.stack_changes or c.prompt_tokens_changed
    verdict = Verdict.STACK_CHANGE if moved else Verdict.LEARNING
    evidence = state.evidence() if state is not None and verdict is Verdict.LEARNING else None
    return replace(c, verdict=verdict, reasons=(why, *c.reasons), evidence=evidence)


def outside(model: NoiseModel, base: Observation) -> str | None:
    """Why the baseline lies outside the noise just measured (None: it does not): its answer (when both
    rest on the same basis) or its reasoning tokens; the check ``baseline calibrate`` and a learning window
    make before a model is saved. Latency is left out: the baseline's was measured
    another day, under another load."""
    if model.basis == basis_of(base) and (ev := score(model, base)).out:
        why = (
            f"D {ev.statistic:.3g} > {ev.threshold:.3g}, max |Δ logprob| {ev.detail['max_abs_dlogprob']:.3g}"
            if model.basis == "logprobs"
            else f"its text is none of the {model.k} answers"
        )
    elif (evs := score_signals(model.signals, base, ["reasoning_tokens"])) and evs[0].out:
        low, high = evs[0].detail["calibrated_range"]
        why = f"its reasoning tokens {evs[0].detail['value']:g}, calibrated {low:g}..{high:g}"
    else:
        return None
    return (
        f"the baseline lies outside the noise just measured ({why}): the stack moved since the baseline; "
        "`baseline accept` it first, or investigate"
    )


def window_shift_p(model: NoiseModel, seed: int = 0) -> float:
    """The permutation p-value that the window (its probes in sending order) holds no change point: the
    statistic is the largest energy distance between the probes before and after any split (each side at
    least 2), over the model's standardised distances, weighted by ``t·(n − t)/n`` (the e-divisive scan);
    its null, the same over ``PERMUTATIONS`` shuffles of the order. Honest noise is exchangeable in time,
    a change is not: it splits the window. 1.0 below 6 probes (too few to tell)."""
    refs = model.refs
    n = len(refs)
    if n < 6:
        return 1.0
    d = np.array([[distance(a, b, model.spread, model.default_spread) for b in refs] for a in refs])
    t = np.arange(2, n - 1)  # probes before the split
    u = n - t

    def scan(m: np.ndarray) -> float:
        c = m.cumsum(0).cumsum(1)
        within_a = c[t - 1, t - 1]  # ordered pairs: each pair twice, as in the means below
        rows_a = c[t - 1, n - 1]
        cross = rows_a - within_a
        within_b = c[n - 1, n - 1] - 2 * rows_a + within_a
        energy = 2 * cross / (t * u) - within_a / (t * (t - 1)) - within_b / (u * (u - 1))
        return float((energy * t * u / n).max())

    seen = scan(d)
    rng = np.random.default_rng(seed)
    beyond = 0
    for _ in range(PERMUTATIONS):
        order = rng.permutation(n)
        beyond += scan(d[np.ix_(order, order)]) >= seen
    return (1 + beyond) / (1 + PERMUTATIONS)


def resolvable(state: Learning) -> bool:
    """Whether `window_shift_p` can tell the probes since ``state.suspect`` from those before them: a split
    of m of n probes is one of C(n, m) orders, so its p-value cannot fall below about 1/C(n, m)."""
    if state.suspect is None:
        return True
    return math.comb(state.k, state.k - state.suspect) * SHIFT_ALPHA >= 2


def newest_within(state: Learning, newest: int) -> bool:
    """Whether the window's ``newest`` probes (the pass that filled it) lie within the noise of the probes
    before them: a change in that very pass is too recent for `window_shift_p` to see, so a window whose
    newest probes are out waits a pass (they then show as a split in time)."""
    if newest <= 0 or state.k - newest < MIN_FIT:
        return True
    earlier = fit_points(state.request_hash, state.points[:-newest], {})
    return not any(score_point(earlier, x).out for x in state.points[-newest:])
