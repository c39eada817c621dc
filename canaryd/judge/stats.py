"""Telling noise from change: the calibrated noise model of a canary × backend, and the decision rules.

Pure functions over observations; no I/O. ``canaryd baseline calibrate`` sends each canary K times (alone
and inside crowded batches) and `fit` turns those K probes into a `NoiseModel`. Every later probe is
scored against it (`score`) and every probe cycle of a backend is combined (`decide`).

**The per-probe statistic** (mode-aware nearest neighbour, after docs/detection-research.md §3.3). A probe
is a point whose coordinates are logprobs: for each generated position, the chosen token's and every top-k
alternative's, keyed by (position, token). Two probes are compared only where their contexts agree (up to
and including the first position where their tokens part). Each coordinate is standardised by its
calibrated spread ``s_j = max(1.4826·MAD_j, range_j/4, S_FLOOR)``, and the distance is the RMS of the
standardised differences. The statistic ``D`` is the distance to the *nearest* calibration probe.

Why nearest and not the mean: batched GPU serving does not jitter around one value; it jumps between a
few discrete numerical paths (modes) whose mix follows the load. A mean-based test cries wolf whenever the
mix moves; "does this probe lie on a mode we have seen?" does not.

**The threshold and its p-value** (split conformal). Each calibration probe's leave-one-out distance to
its nearest other probe gives the null distribution of ``D``. The conformal p-value is
``p = (1 + #{LOO ≥ D}) / (K + 1)``, valid whenever the calibration probes and later honest probes are
exchangeable. A canary is *out* when ``D`` exceeds every leave-one-out distance by the guard band
(``D > (1 + GUARD)·max LOO``), so ``P(out | no change) ≤ 1/(K+1)``. With a noise floor of exactly zero
(the K probes were bit-identical: a batch-invariant or deterministic engine) the threshold is 0 and any
change counts: the EXACT regime.

**Combining canaries and cycles** (`decide`). A per-canary bound of 1/(K+1) is too loose for a pager, so
outside the EXACT regime one out canary is only a drift verdict when the backend's alarm is on:

* fast path: at least ``m`` calibrated canaries are out in the same cycle, where ``m`` (`min_out_for`) is
  the smallest count whose chance under no change, ``C(n, m)·q^m`` with ``q`` the largest per-canary
  bound (1/(K+1), or a sampled canary's alpha), is at most ``1/arl``. That bound treats canaries as
  independent; a fixed ``min_out`` in the config overrides it. With few canaries or a small K no count
  qualifies, and only the slow path can alarm: calibrate with a larger K to decide in one cycle;
* slow path: an e-CUSUM detector. Each p-value becomes an e-value ``e = κ·p^(κ−1)`` (κ = 0.5), the cycle's
  e-value ``E_t`` is their mean (valid under any dependence), and ``M_t = E_t·max(M_{t−1}, 1)``. The alarm
  is ``M_t ≥ A``; by the e-detector bound (Shin, Ramdas & Rinaldo 2023) the average run length to a false
  alarm is at least ``A`` cycles. That needs each cycle's e-value valid given the past; conformal
  p-values against one fixed calibration are valid on average over calibrations, so the bound is
  approximate (recalibrating after a stack change renews it). It catches small persistent shifts no
  single cycle proves.

**A model that lives** (`canaryd.judge.living`, whose docstring gives the rule). Honest noise grows with
load, fleet size and batch mix, and a frozen model would page for ever. A canary out of its noise whose
logprobs kept their signed location (a signed-rank statistic against the first model's centre, scale-free,
its null the first K probes' own) is refit: its answer and a few more probes are *added* as references,
within a cap on how far any may stand (``refit_cap`` × the first model's largest leave-one-out distance).
The first K probes, their spread and centre never move, nor does the baseline, so a shift or a slow ramp
(one-way moves) is never followed. After a refit ``p`` is taken against the added references'
leave-one-out distances (the noise as it is now); the out threshold stays the one over all references.

**Signals beyond logprobs**: the same K probes calibrate each canary's reasoning tokens and latency
(`canaryd.judge.signals`, whose docstring gives their rules).

A chain's steps count as one canary (their inputs depend on each other): out if any step is, with the
sum of the steps' bounds, and the mean of their e-values. A sampled canary's two-sample test decides at
its own alpha and is never held back.

In the EXACT regime every out canary is a drift verdict at once, and the detector still runs (so the
alarm series means the same on every backend). The alarm there waits for the same canary to move in two
consecutive cycles (or for ``m`` at once): a zero noise floor is a claim made from K probes, and an engine
bit-identical over K can still blip once (a kernel path K never hit); a changed stack keeps moving. The
verdict does not wait, so a one-cycle blip is on record (the drift alerts page only if it lasts their
``for: 1m``), but it cannot latch the alarm that only recalibration clears.
"""

from __future__ import annotations

import enum
import hashlib
import math
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from canaryd.judge.evidence import GUARD, S_FLOOR, Evidence, p_to_e, robust_spread
from canaryd.judge.nearest import Nearest, common_prefix
from canaryd.judge.signals import SignalFit
from canaryd.observation import Observation, logprob_problem, tokens_problem

MIN_SUPPORT = 3  # coordinates seen in fewer calibration probes borrow the canary's median spread

Key = tuple[int, str]


class Regime(enum.StrEnum):
    """How the calibration probes spread (docs/detection-research.md §2.1)."""

    EXACT = "exact"  # one bit-exact signature: any change counts
    MODAL = "modal"  # a few signatures (at most K/3): discrete numerical paths
    CONTINUOUS = "continuous"  # nearly every probe different


@dataclass(frozen=True, slots=True)
class Point:
    """One probe as the statistics see it: its token identity and its logprob coordinates."""

    ids: tuple[str, ...]
    coords: Mapping[Key, float]

    @property
    def completion(self) -> str:
        return hashlib.sha256("\x1f".join(self.ids).encode()).hexdigest()[:16]

    @property
    def signature(self) -> str:
        exact = sorted((p, t, v.hex()) for (p, t), v in self.coords.items())
        return hashlib.sha256(repr((self.ids, exact)).encode()).hexdigest()[:16]

    def as_list(self) -> list:
        return [list(self.ids), [[p, t, v] for (p, t), v in sorted(self.coords.items())]]

    @classmethod
    def from_list(cls, doc: list) -> Point:
        ids, coords = doc
        return cls(tuple(ids), {(int(p), str(t)): float(v) for p, t, v in coords})


def point(obs: Observation, text: bool = False) -> Point:
    """The observation's point. Token ids identify tokens when the server sent them, else token text;
    ``text``: its text alone (as a model learned without logprobs sees every answer)."""
    ids: list[str] = []
    coords: dict[Key, float] = {}
    for i, t in enumerate(obs.tokens):
        ids.append(str(t.token_id) if t.token_id is not None else t.token)
        for tok, lp in t.top:
            coords[(i, tok)] = lp
        coords[(i, t.token)] = t.logprob
    if text or not obs.has_logprobs or (not obs.tokens and obs.text is not None):  # identity is the text
        ids, coords = [obs.text or ""], {}
    return Point(tuple(ids), coords)


def aligned(x: Point, b: Point) -> list[Key]:
    """Coordinates both probes have under the same context: positions up to where their tokens part."""
    last = common_prefix(x.ids, b.ids)
    return [k for k in x.coords if k[0] <= last and k in b.coords]


def distance(x: Point, b: Point, spread: Mapping[Key, float], default: float) -> float:
    """RMS of the standardised logprob differences over the aligned coordinates (0 when none). One pass
    over ``x``'s coordinates, the terms in `aligned`'s order and summed by `sum` as before. The fit's
    leave-one-out distances and a model's first score take it; later scores take `Nearest.score`, whose
    results are these to the bit."""
    last, other, scale = common_prefix(x.ids, b.ids), b.coords, spread.get
    terms = [
        ((v - w) / scale(k, default)) ** 2
        for k, v in x.coords.items()
        if k[0] <= last and (w := other.get(k)) is not None
    ]
    return math.sqrt(sum(terms) / len(terms)) if terms else 0.0


def max_abs_delta(x: Point, b: Point) -> float:
    """The effect size in nats: the largest aligned |Δ logprob|."""
    return max((abs(x.coords[k] - b.coords[k]) for k in aligned(x, b)), default=0.0)


def noise_floor(model: NoiseModel) -> float:
    """The largest |Δ logprob| between two of the K honest probes at one aligned coordinate, in nats: how
    far this backend's own answers move from call to call (0 in the exact regime). A reference check
    counts nothing within it as evidence (`canaryd.probe.reference.run_checks`): a provider whose logprobs
    wander this much between its own calls wanders as much from a deterministic reference. The largest
    move at one token, not a mean, bounds the logprob gap too (itself a mean): a floor of the chosen
    tokens' mean moves called 5–41% of honest tests a mismatch under the detection bench's mode noise
    (a provider's modes can all lie to one side of the reference), this one none of 5,000."""
    refs = model.refs
    return max(
        (max_abs_delta(a, b) for i, a in enumerate(refs) for b in refs[i + 1 :] if a.coords and b.coords),
        default=0.0,
    )


SIGNALS = ("reasoning_tokens", "latency_s")  # calibrated beside the logprobs (canaryd.judge.signals)


@dataclass(frozen=True, slots=True)
class Refit:
    """How a living calibration has grown since it was fitted (`canaryd.judge.living`): ``refs[:first]``
    are the model as first fitted, whose spread and centre no refit moves; ``loo_max`` is that model's
    largest leave-one-out distance (the first threshold the record shows; the widening cap is measured
    against the first model's reach, `canaryd.judge.living.reach`)."""

    first: int
    count: int
    at: str  # when the last refit was made (ISO 8601, UTC)
    loo_max: float

    def as_dict(self) -> dict:
        return {"first": self.first, "count": self.count, "at": self.at, "loo_max": self.loo_max}


@dataclass(frozen=True, slots=True)
class NoiseModel:
    """What K honest probes of one canary × backend look like; `score` judges a new probe against it."""

    request_hash: str
    refs: tuple[Point, ...]
    spread: Mapping[Key, float]
    default_spread: float
    loo: tuple[float, ...]  # each probe's distance to its nearest other probe
    # the K probes' reasoning tokens and latency (seconds), when every probe had them
    signal_values: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    refit: Refit | None = None  # None: the model as fitted
    # derived from refs once (hashing every coordinate is most of what scoring would cost)
    signatures: int = field(init=False)
    completions: Counter[str] = field(init=False)
    regime: Regime = field(init=False)
    signals: dict[str, SignalFit] = field(init=False)  # the signal_values fitted
    _scored: bool = field(init=False, default=False, repr=False, compare=False)
    _nearest: Nearest | None = field(init=False, default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len({r.signature for r in self.refs})
        regime = Regime.EXACT if n == 1 else Regime.MODAL if n <= len(self.refs) / 3 else Regime.CONTINUOUS
        object.__setattr__(self, "signatures", n)
        object.__setattr__(self, "completions", Counter(r.completion for r in self.refs))
        object.__setattr__(self, "regime", regime)
        fits = {
            name: SignalFit(name, tuple(math.log(v) for v in vs) if name == "latency_s" else tuple(vs))
            for name, vs in self.signal_values.items()
        }
        object.__setattr__(self, "signals", fits)

    def nearest(self) -> Nearest | None:
        """The references as arrays for `score_point`, from the model's second score on (None before).
        They cost about as much to build as scoring one probe a reference at a time: a model scored once
        (a learning window's, one `canaryd check`'s) is not worth them; one the daemon keeps is."""
        if self._nearest is None:
            if not self._scored:
                object.__setattr__(self, "_scored", True)
                return None
            object.__setattr__(self, "_nearest", Nearest(self.refs, self.spread, self.default_spread))
        return self._nearest

    @property
    def basis(self) -> str:
        """ "text" when the K probes carried no logprobs (each point is its text alone)."""
        return "logprobs" if any(r.coords for r in self.refs) else "text"

    @property
    def k(self) -> int:
        return len(self.refs)

    @property
    def threshold(self) -> float:
        return 0.0 if self.regime is Regime.EXACT else (1 + GUARD) * max(self.loo)

    def first_divergences(self) -> list[int | None]:
        """Where each probe leaves the modal completion (None: it is the modal completion)."""
        modal = self.completions.most_common(1)[0][0]
        ref = next(r for r in self.refs if r.completion == modal)
        return [None if r.completion == modal else common_prefix(r.ids, ref.ids) for r in self.refs]

    def abs_deltas(self) -> list[float]:
        """Per-token |Δ logprob| of every probe from each coordinate's median: the raw noise floor."""
        values: dict[Key, list[float]] = {}
        for r in self.refs:
            for k, v in r.coords.items():
                values.setdefault(k, []).append(v)
        return sorted(abs(v - statistics.median(vs)) for vs in values.values() for v in vs)

    def summary(self) -> dict:
        """The noise floor in figures: what `baseline calibrate` prints and the verdicts cite."""
        spreads = sorted(self.spread.values())
        deltas = self.abs_deltas()
        return {
            "k": self.k,
            "regime": self.regime.value,
            "signatures": self.signatures,
            "completions": len(self.completions),
            "first_divergence": self.first_divergences(),
            "abs_dlogprob_p50": _quantile(deltas, 0.5),
            "abs_dlogprob_p99": _quantile(deltas, 0.99),
            "abs_dlogprob_max": deltas[-1] if deltas else 0.0,
            "spread_median": statistics.median(spreads) if spreads else 0.0,
            "spread_max": spreads[-1] if spreads else 0.0,
            "loo_max": max(self.loo),
            "threshold": self.threshold,
            "basis": self.basis,
            **{name: fit.summary() for name, fit in self.signals.items()},
            **(
                {"refit": {**self.refit.as_dict(), "threshold_first": (1 + GUARD) * self.refit.loo_max}}
                if self.refit
                else {}
            ),
        }

    def as_dict(self) -> dict:
        return {
            "request_hash": self.request_hash,
            "refs": [r.as_list() for r in self.refs],
            "spread": [[p, t, s] for (p, t), s in sorted(self.spread.items())],
            "default_spread": self.default_spread,
            "loo": list(self.loo),
            "signals": {name: list(vs) for name, vs in self.signal_values.items()},
            **({"refit": self.refit.as_dict()} if self.refit else {}),
        }

    @classmethod
    def from_dict(cls, doc: dict) -> NoiseModel:
        """The stored model; `CalibrationError` when it holds values no calibration can have produced
        (unusable logprobs, a spread or distance that is not a finite positive number). A document the
        store holds between passes (`canaryd.store.cache.Doc`) keeps the model: it is parsed once."""
        if (parsed := getattr(doc, "parsed", None)) is not None:
            return parsed
        model = cls(
            request_hash=doc["request_hash"],
            refs=tuple(Point.from_list(r) for r in doc["refs"]),
            spread={(int(p), str(t)): float(s) for p, t, s in doc["spread"]},
            default_spread=float(doc["default_spread"]),
            loo=tuple(float(x) for x in doc["loo"]),
            signal_values=_signal_values(doc.get("signals") or {}),  # absent: calibrated by an older version
            refit=_refit(doc.get("refit"), len(doc["refs"])),
        )
        for i, ref in enumerate(model.refs):
            for (pos, tok), v in ref.coords.items():
                if (why := logprob_problem(v)) is not None:
                    raise CalibrationError(f"refs.{i}: logprob at {pos} {tok!r}: {why}")
        scales = [*model.spread.values(), model.default_spread]
        if not all(math.isfinite(v) and v > 0 for v in scales):
            raise CalibrationError("a spread is not a finite positive number")
        if not model.loo or not all(math.isfinite(v) and v >= 0 for v in model.loo):
            raise CalibrationError("a leave-one-out distance is not a finite number >= 0")
        if hasattr(doc, "parsed"):
            doc.parsed = model  # type: ignore[attr-defined]
        return model


def _signal_values(doc: Mapping) -> dict[str, tuple[float, ...]]:
    out = {}
    for name, values in doc.items():
        if name not in SIGNALS:
            raise CalibrationError(f"signals: unknown signal {name!r}")
        vs = tuple(float(v) for v in values)
        if (
            len(vs) < 2
            or not all(math.isfinite(v) and v >= 0 for v in vs)
            or (name == "latency_s" and 0 in vs)
        ):
            raise CalibrationError(f"signals.{name}: not at least 2 finite values >= 0")
        out[name] = vs
    return out


def _refit(doc: Mapping | None, k: int) -> Refit | None:
    if doc is None:
        return None
    refit = Refit(int(doc["first"]), int(doc["count"]), str(doc["at"]), float(doc["loo_max"]))
    if not (
        2 <= refit.first < k and refit.count >= 1 and math.isfinite(refit.loo_max) and refit.loo_max >= 0
    ):
        raise CalibrationError("refit: not a refit of this model's first probes")
    return refit


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))] if sorted_values else 0.0


class CalibrationError(ValueError):
    """Too few usable probes, or probes of different requests."""


def fit(observations: Sequence[Observation]) -> NoiseModel:
    """Learn the noise model from K ≥ 2 honest probes of one request (failed probes are left out; one with
    an unusable logprob, which the probe pass would have made an error, is a `CalibrationError`)."""
    ok = [o for o in observations if o.ok]
    for i, o in enumerate(ok):
        if (why := tokens_problem(o.tokens)) is not None:
            raise CalibrationError(f"calibration probe {i}: {why}")
    if len(ok) < 2:
        raise CalibrationError(f"need at least 2 successful probes to calibrate, got {len(ok)}")
    if len({o.request_hash for o in ok}) != 1:
        raise CalibrationError("calibration probes must all be of the same request")
    signals: dict[str, tuple[float, ...]] = {}
    reasoning = [o.reasoning_tokens for o in ok]
    if all(r is not None for r in reasoning):
        signals["reasoning_tokens"] = tuple(float(r) for r in reasoning)  # type: ignore[arg-type]
    if all(o.latency_s > 0 for o in ok):
        signals["latency_s"] = tuple(o.latency_s for o in ok)
    return fit_points(ok[0].request_hash, tuple(point(o) for o in ok), signals)


def fit_points(
    request_hash: str, refs: tuple[Point, ...], signals: Mapping[str, tuple[float, ...]]
) -> NoiseModel:
    """The model of K ≥ 2 honest probes already turned into points (`fit`, and a learning window that
    keeps points across passes: ``canaryd.judge.learning``); ``signals``: each calibrated signal's K
    values, in the points' order."""
    if len(refs) < 2:
        raise CalibrationError(f"need at least 2 successful probes to calibrate, got {len(refs)}")
    values: dict[Key, list[float]] = {}
    for r in refs:
        for k, v in r.coords.items():
            values.setdefault(k, []).append(v)
    supported = {k: robust_spread(v) for k, v in values.items() if len(v) >= MIN_SUPPORT}
    default = statistics.median(supported.values()) if supported else S_FLOOR
    spread = {k: supported.get(k, default) for k in values}
    loo = tuple(
        min(distance(r, o, spread, default) for j, o in enumerate(refs) if j != i) for i, r in enumerate(refs)
    )
    return NoiseModel(request_hash, refs, spread, default, loo, dict(signals))


def score(model: NoiseModel, obs: Observation) -> Evidence:
    """How far ``obs`` lies from every honest probe, against the calibrated leave-one-out distances."""
    return score_point(model, point(obs, text=model.basis == "text"))


def score_point(model: NoiseModel, x: Point) -> Evidence:
    """`score` of a probe already turned into its point."""
    if x in model.refs:
        d = moved = 0.0  # a repeat of an honest probe (every probe of an exact backend): what the below give
    elif (near := model.nearest()) is None:
        dists = [distance(x, r, model.spread, model.default_spread) for r in model.refs]
        nearest = min(range(model.k), key=dists.__getitem__)
        d, moved = dists[nearest], max_abs_delta(x, model.refs[nearest])
    else:
        dists, nearest, moved = near.score(x)  # the same, to the bit
        d = dists[nearest]
    novel = x.completion not in model.completions
    if novel and d == 0.0:
        # tokens no honest probe produced, with nothing aligned that moved (or no logprobs at all): a change
        d = math.nextafter(0.0, 1.0)
    null = model.loo[model.refit.first :] if model.refit else model.loo  # a refit: the noise as it is now
    p = (1 + sum(1 for v in null if v >= d)) / (len(null) + 1)
    return Evidence(
        method="exact" if model.regime is Regime.EXACT else "conformal-nn",
        statistic=d,
        threshold=model.threshold,
        p_value=p,
        e_value=p_to_e(p),
        detail={
            "regime": model.regime.value,
            "k": model.k,
            "novel_completion": novel,
            "max_abs_dlogprob": moved,
            "loo_max": max(model.loo),
        },
    )


@dataclass(frozen=True, slots=True)
class DetectorState:
    """The e-CUSUM statistic of one backend, carried from cycle to cycle (and across restarts)."""

    statistic: float = 1.0
    cycles: int = 0
    alarm: bool = False
    pending: tuple[str, ...] = ()  # exact-regime canaries that moved last cycle: moving again is the alarm

    def as_dict(self) -> dict:
        """The plain form the store keeps (``canaryd.store.records.DetectorDoc``)."""
        return {
            "statistic": self.statistic,
            "cycles": self.cycles,
            "alarm": self.alarm,
            "pending": list(self.pending),
        }

    @classmethod
    def from_dict(cls, doc: Mapping) -> DetectorState:
        return cls(float(doc["statistic"]), int(doc["cycles"]), bool(doc["alarm"]), tuple(doc["pending"]))


def out_bound(ev: Evidence) -> float:
    """An upper bound on P(out | no change) for one canary: m/(K+1) calibrated (m signals scored, a union
    bound), alpha for a sampled one."""
    if "k" in ev.detail:
        return min(1.0, ev.detail.get("signals_scored", 1) / (ev.detail["k"] + 1))
    return float(ev.detail["alpha"])


def min_out_for(bounds: Sequence[float], arl: float) -> int | None:
    """The fewest out canaries that are an alarm in one cycle: the smallest m with C(n, m)·q^m ≤ 1/arl
    (q the largest bound: independent canaries). None when even all n out would be too likely."""
    q = max(bounds)
    return next((m for m in range(1, len(bounds) + 1) if math.comb(len(bounds), m) * q**m <= 1 / arl), None)


def cusum(previous: float, e: float) -> float:
    """The e-CUSUM recursion M_t = E_t·max(M_{t−1}, 1)."""
    return e * max(previous, 1.0)
