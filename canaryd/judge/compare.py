"""Compare an observation with its baseline and classify it: pure functions, no I/O.

The verdicts (values, severity order, which count as drift, colours and meanings) are one table,
``canaryd.judge.verdicts.Verdict``: `compare` gives an observation the most severe verdict that applies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from canaryd.fleet import comparable, set_aside
from canaryd.judge.evidence import Evidence, cycle_evalue
from canaryd.judge.signals import combine, score_signals
from canaryd.judge.stats import DetectorState, NoiseModel, common_prefix, cusum, min_out_for, out_bound, score
from canaryd.judge.verdicts import Verdict
from canaryd.observation import ErrorKind, Observation, TokenLogprob, tokens_problem
from canaryd.stack import FieldChange, split

__all__ = [
    "Comparison",
    "Decision",
    "Evidence",
    "TokenDelta",
    "Verdict",
    "basis_of",
    "compare",
    "decide",
    "new_configuration",
    "text_delta",
    "token_delta",
]


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """Token-level agreement of two generations over their common prefix."""

    first_divergence: int | None  # first index where tokens differ; None when all tokens agree
    common_prefix: int
    max_abs_dlogprob: float | None  # chosen tokens, over the common prefix
    mean_abs_dlogprob: float | None
    max_abs_dtop: float | None  # top-k alternatives present in both, over the common prefix
    topk_overlap: float | None  # mean Jaccard overlap of the top-k token sets


@dataclass(frozen=True, slots=True)
class Comparison:
    verdict: Verdict
    correct: bool | None
    baseline_correct: bool | None = None
    text_identical: bool | None = None
    delta: TokenDelta | None = None
    prompt_tokens_changed: bool = False
    fingerprint_changed: bool = False
    stack_changes: tuple[FieldChange, ...] = ()
    # fields canaryd records differently than when the baseline was taken (`canaryd.stack.split`)
    recording_changes: tuple[FieldChange, ...] = ()
    reasons: tuple[str, ...] = field(default=())
    evidence: Evidence | None = None
    first_diverged_step: str | None = None  # a chain's final step: the first step whose output moved
    # what the comparison rests on: "logprobs", or "text" (an answer or its baseline carried no logprobs:
    # text, usage, fingerprint and stack only; ``delta.first_divergence`` then counts characters)
    basis: str = "logprobs"
    latency: Evidence | None = None  # the calibrated latency signal, its own (see `decide`)
    reference: dict | None = None  # the backend's reference check of this answer (`probe.reference.evidence`)

    def as_dict(self) -> dict:
        return {
            "verdict": self.verdict.value,
            "basis": self.basis,
            "correct": self.correct,
            "baseline_correct": self.baseline_correct,
            "text_identical": self.text_identical,
            "delta": None
            if self.delta is None
            else {
                "first_divergence": self.delta.first_divergence,
                "common_prefix": self.delta.common_prefix,
                "max_abs_dlogprob": self.delta.max_abs_dlogprob,
                "mean_abs_dlogprob": self.delta.mean_abs_dlogprob,
                "max_abs_dtop": self.delta.max_abs_dtop,
                "topk_overlap": self.delta.topk_overlap,
            },
            "prompt_tokens_changed": self.prompt_tokens_changed,
            "fingerprint_changed": self.fingerprint_changed,
            "stack_changes": _dicts(self.stack_changes),
            **({"recording_changes": _dicts(self.recording_changes)} if self.recording_changes else {}),
            "reasons": list(self.reasons),
            "evidence": None if self.evidence is None else self.evidence.as_dict(),
            "first_diverged_step": self.first_diverged_step,
            "latency": None if self.latency is None else self.latency.as_dict(),
            "reference": self.reference,
        }


def _dicts(changes: Sequence[FieldChange]) -> list[dict]:
    return [{"field": c.field, "before": c.before, "after": c.after} for c in changes]


def token_delta(base: list[TokenLogprob], cur: list[TokenLogprob]) -> TokenDelta:
    """Where two generations part, and how far their logprobs moved before that point."""
    n = 0
    for a, b in zip(base, cur, strict=False):
        if a.token != b.token or (
            a.token_id is not None and b.token_id is not None and a.token_id != b.token_id
        ):
            break
        n += 1
    diverged = n < max(len(base), len(cur))
    if n == 0:
        return TokenDelta(n if diverged else None, 0, None, None, None, None)
    chosen = [abs(a.logprob - b.logprob) for a, b in zip(base[:n], cur[:n], strict=True)]
    top_deltas: list[float] = []
    overlaps: list[float] = []
    for a, b in zip(base[:n], cur[:n], strict=True):
        if a.top == b.top:  # the common case on an exact backend: nothing moved at this position
            if a.top:
                overlaps.append(1.0)
                top_deltas.append(0.0)
            continue
        ta, tb = dict(a.top), dict(b.top)
        both = ta.keys() & tb.keys()
        overlaps.append(len(both) / len(ta.keys() | tb.keys()))
        top_deltas.extend(abs(ta[t] - tb[t]) for t in both)
    return TokenDelta(
        first_divergence=n if diverged else None,
        common_prefix=n,
        max_abs_dlogprob=max(chosen),
        mean_abs_dlogprob=sum(chosen) / n,
        max_abs_dtop=max(top_deltas) if top_deltas else None,
        topk_overlap=sum(overlaps) / len(overlaps) if overlaps else None,
    )


def text_delta(base: str, cur: str) -> TokenDelta:
    """Where two answers without logprobs part, in characters (no logprob figures)."""
    n = common_prefix(base, cur)
    return TokenDelta(None if base == cur else n, n, None, None, None, None)


def basis_of(*observations: Observation) -> str:
    """ "logprobs" when every one carried per-token logprobs, else "text" (text, usage and stack only)."""
    return "logprobs" if all(o.has_logprobs for o in observations) else "text"


def _prompt_changed(baseline: Observation, current: Observation) -> bool:
    counts = baseline.prompt_tokens, current.prompt_tokens
    return None not in counts and counts[0] != counts[1]


def _usage_changes(baseline: Observation, current: Observation, text_basis: bool) -> list[str]:
    """Usage counts that moved although nothing else explains it: the prompt's tokens (a hidden system
    prompt, another template or tokenizer), on the text basis the visible completion tokens of the same
    text, and whether reasoning tokens are reported at all."""
    out = []
    if _prompt_changed(baseline, current):
        out.append(f"prompt tokens {baseline.prompt_tokens} -> {current.prompt_tokens}")
    seen = _visible(baseline), _visible(current)
    if text_basis and baseline.text == current.text and None not in seen and seen[0] != seen[1]:
        out.append(f"completion tokens {seen[0]} -> {seen[1]} for the same text")
    if (baseline.reasoning_tokens is None) != (current.reasoning_tokens is None):
        out.append(f"reasoning tokens {baseline.reasoning_tokens} -> {current.reasoning_tokens}")
    return out


def _visible(obs: Observation) -> int | None:
    """Completion tokens net of hidden reasoning (which OpenAI-style usage counts among them)."""
    if obs.completion_tokens is None:
        return None
    return obs.completion_tokens - (obs.reasoning_tokens or 0)


def compare(
    baseline: Observation | None,
    current: Observation,
    *,
    correct: bool | None,
    baseline_correct: bool | None = None,
    logprob_tolerance: float = 0.0,
    noise: NoiseModel | None = None,
) -> Comparison:
    """Classify ``current`` against ``baseline`` (the verdict order is `canaryd.judge.verdicts.Verdict`).

    ``correct``/``baseline_correct`` come from the canary's expected answer (None when it has none), so
    this function needs no canary and stays trivially testable. With a calibrated ``noise`` model of this
    request, whether something moved *beyond noise* is decided by `stats.score` (its evidence rides on the
    comparison) instead of by ``logprob_tolerance``.

    The **basis** is what the comparison rests on: ``logprobs`` when both answers carried them, else
    ``text`` (an answer without logprobs is still an observation): correctness, the text (its first
    divergence in characters), prompt, visible completion and reasoning tokens, fingerprint and stack, and
    with a calibration the reasoning tokens' and latency's spread. A basis change alone (logprobs then
    none, or the reverse) is no drift: the pair is judged on text, and a reason says so. Reasoning tokens
    that moved without a calibration are ``answer-drift`` (hidden generated tokens differ, as a token does);
    latency is compared only against a calibration, and is its own signal (``latency``): out alone it
    changes no verdict here; `decide` makes it a ``stack-change`` when enough canaries of the backend
    are out on latency in the same cycle.

    Unusable logprobs (NaN, ±inf, above 0, absurdly negative: `canaryd.observation.logprob_problem`) are
    never compared: in ``current`` they are an error; a ``baseline`` with them (stored by an older version)
    is refused, and ``current`` becomes the baseline (a ``baseline`` verdict, with the reason).
    """
    own = basis_of(current)
    if not current.ok:
        return Comparison(Verdict.ERROR, None, reasons=(f"{current.error_kind}: {current.error}",), basis=own)
    if (bad := tokens_problem(current.tokens)) is not None:  # the probe pass vets answers; callers may not
        return Comparison(Verdict.ERROR, None, reasons=(f"{ErrorKind.INVALID_RESPONSE}: {bad}",), basis=own)
    if baseline is None:
        return Comparison(
            Verdict.BASELINE, correct, reasons=("no baseline yet: this observation becomes it",), basis=own
        )
    if (bad := tokens_problem(baseline.tokens)) is not None:  # stored by a version that did not vet them
        return Comparison(
            Verdict.BASELINE,
            correct,
            reasons=(f"stored baseline refused ({bad}): this observation replaces it",),
            basis=own,
        )
    if baseline.request_hash != current.request_hash:
        return Comparison(
            Verdict.BASELINE,
            correct,
            reasons=("canary request changed since the baseline: new baseline",),
            basis=own,
        )

    basis = basis_of(baseline, current)
    text_basis = basis == "text"
    delta = (
        text_delta(baseline.text or "", current.text or "")
        if text_basis
        else token_delta(baseline.tokens, current.tokens)
    )
    text_identical = baseline.text == current.text
    before, after, aside = comparable(baseline.stack, current.stack)  # a fleet's snapshot (`canaryd.fleet`)
    changed, recorded = split(before, after)
    stack_changes, recording_changes = tuple(changed), tuple(recorded)
    fingerprint_changed = baseline.system_fingerprint != current.system_fingerprint
    usage = _usage_changes(baseline, current, text_basis)
    reasons: list[str] = []
    if baseline.has_logprobs != current.has_logprobs:
        reasons.append(
            "the baseline has logprobs, this answer none: judged on text"
            if baseline.has_logprobs
            else "the baseline has no logprobs: judged on text"
        )
    if stack_changes:
        reasons.append(f"stack changed ({len(stack_changes)} field{'s' if len(stack_changes) > 1 else ''})")
    reasons.extend(usage)
    if aside:
        reasons.append(set_aside(aside))

    tokens_same = delta.first_divergence is None and text_identical
    moved = max(delta.max_abs_dlogprob or 0.0, delta.max_abs_dtop or 0.0)
    topk_changed = delta.topk_overlap is not None and delta.topk_overlap < 1.0
    reasoning = (baseline.reasoning_tokens, current.reasoning_tokens)
    reasoning_moved = None not in reasoning and reasoning[0] != reasoning[1]
    point_ev, signals = None, {}
    if noise is not None and noise.request_hash == current.request_hash:
        if noise.basis == basis:
            point_ev = score(noise, current)
        else:
            reasons.append(
                f"calibrated on {noise.basis}, compared on {basis}: the answer judged uncalibrated"
            )
        signals = {ev.detail["signal"]: ev for ev in score_signals(noise.signals, current)}
    elif noise is not None:
        reasons.append("calibration is for an older request of this canary: run `baseline calibrate`")
    latency_ev = signals.pop("latency_s", None)
    scored = [ev for ev in (point_ev, *signals.values()) if ev is not None]
    evidence = replace(combine(scored), basis=basis) if scored else None

    if point_ev is not None:
        answer_beyond = point_ev.out
    else:
        # A top-k membership swap is itself a logprob move; with a tolerance set it may be boundary noise.
        topk_changed = topk_changed and logprob_tolerance == 0
        answer_beyond = (
            not tokens_same
            or moved > logprob_tolerance
            or topk_changed
            or (bool(baseline_correct) and correct is False)
        )
    if point_ev is None and answer_beyond:  # drift on the answer alone, which no calibration covers: the
        evidence = None  # signals' evidence must not let the cycle's decision hold it back as noise
    reasoning_ev = signals.get("reasoning_tokens")
    reasoning_beyond = reasoning_ev.out if reasoning_ev is not None else reasoning_moved
    if latency_ev is not None and latency_ev.out:
        reasons.append(_evidence_reason(latency_ev, "latency beyond the calibrated spread"))

    if not (answer_beyond or reasoning_beyond):
        if stack_changes or usage:  # the stack moved under a probe within noise: still say so
            verdict = Verdict.STACK_CHANGE
        elif evidence is not None and (not tokens_same or moved > 0 or topk_changed or reasoning_moved):
            verdict = Verdict.NOISE
            reasons.insert(0, _evidence_reason(evidence, "within the calibrated noise"))
        else:
            verdict = Verdict.IDENTICAL
    elif answer_beyond and baseline_correct and correct is False:
        verdict = Verdict.REGRESSION
        reasons.insert(0, "was correct, now wrong")
    elif answer_beyond and not tokens_same:
        verdict = Verdict.ANSWER_DRIFT
        where = delta.first_divergence if delta.first_divergence is not None else delta.common_prefix
        unit = "character" if text_basis else "index"
        reasons.insert(0, f"{'text' if text_basis else 'tokens'} differ from {unit} {where}")
    elif reasoning_beyond:
        verdict = Verdict.ANSWER_DRIFT
        what = f"hidden reasoning tokens {reasoning[0]} -> {reasoning[1]}"
        reasons.insert(
            0,
            _evidence_reason(reasoning_ev, f"{what}, beyond the calibrated spread")
            if reasoning_ev is not None
            else f"{what} (uncalibrated: `baseline calibrate` learns their spread)",
        )
    elif answer_beyond and point_ev is not None:
        verdict = Verdict.ANSWER_DRIFT if text_basis else Verdict.LOGPROB_DRIFT
        reasons.insert(0, _evidence_reason(point_ev, "beyond the calibrated noise"))
    else:
        verdict = Verdict.LOGPROB_DRIFT
        reasons.insert(
            0,
            f"max |Δ logprob| {moved:.3g} > tolerance {logprob_tolerance:g}"
            + (", top-k set changed" if topk_changed else ""),
        )
    return Comparison(
        verdict=verdict,
        correct=correct,
        baseline_correct=baseline_correct,
        text_identical=text_identical,
        delta=delta,
        prompt_tokens_changed=_prompt_changed(baseline, current),
        fingerprint_changed=fingerprint_changed,
        stack_changes=stack_changes,
        recording_changes=recording_changes,
        reasons=tuple(reasons),
        evidence=evidence,
        basis=basis,
        latency=None if latency_ev is None else replace(latency_ev, basis=basis),
    )


def new_configuration(configuration: str, other: str, against: Comparison) -> Comparison:
    """The first answer of ``configuration``, a serving configuration new to this canary × backend, which
    has baselines under others: not drift but a ``new-configuration`` (it becomes its configuration's
    baseline). ``against`` is the answer compared, uncalibrated, with the baseline of configuration
    ``other`` (the most recent one), so its reasons say whether the newcomer behaves differently. It has no
    evidence: a comparison across configurations must not feed the backend's detector."""
    name = configuration or "(none: the answer names no configuration)"
    how = f"against configuration {other} it would be {against.verdict.value}"
    if against.verdict is not Verdict.IDENTICAL and against.reasons:
        how += f": {against.reasons[0]}"
    return Comparison(
        Verdict.NEW_CONFIG,
        against.correct,
        baseline_correct=against.baseline_correct,
        text_identical=against.text_identical,
        delta=against.delta,
        prompt_tokens_changed=against.prompt_tokens_changed,
        fingerprint_changed=against.fingerprint_changed,
        stack_changes=against.stack_changes,
        recording_changes=against.recording_changes,
        reasons=(f"new serving configuration {name}: its first answer becomes its baseline", how),
        basis=against.basis,
    )


def _evidence_reason(evidence: Evidence | None, what: str) -> str:
    if evidence is None:
        return what
    if (signal := evidence.detail.get("signal")) is not None:
        low, high = evidence.detail["calibrated_range"]
        unit = " s" if signal == "latency_s" else ""
        return (
            f"{what}: {signal} {evidence.detail['value']:.4g}{unit} "
            f"vs calibrated {low:.4g}..{high:.4g}{unit} "
            f"(D {evidence.statistic:.3g} vs threshold {evidence.threshold:.3g}, {evidence.method}, "
            f"p {evidence.p_value:.3g})"
        )
    return (
        f"{what}: D {evidence.statistic:.3g} vs threshold {evidence.threshold:.3g} "
        f"({evidence.method}, p {evidence.p_value:.3g}, max |Δ logprob| "
        f"{evidence.detail.get('max_abs_dlogprob', 0.0):.3g})"
    )


def latency_shift(
    canary_ids: Sequence[str], comparisons: Sequence[Comparison], arl: float
) -> list[Comparison]:
    """Latency's higher bar: a canary out on latency is a ``stack-change`` (the same answers, served
    differently) only when at least ``max(2, min_out_for(...))`` calibrated canaries of the backend are out
    on latency in the same cycle, a shift of the whole backend; out alone it is a reason, never drift.
    It does not feed the e-CUSUM: a slow network for an hour must not add up to an alarm."""
    scored: dict[str, list[Evidence]] = {}
    for cid, c in zip(canary_ids, comparisons, strict=True):
        if c.latency is not None:
            scored.setdefault(cid.partition(":")[0], []).append(c.latency)
    out = [q for q, evs in scored.items() if any(ev.out for ev in evs)]
    if not out:
        return list(comparisons)
    need = min_out_for([min(1.0, sum(out_bound(ev) for ev in evs)) for evs in scored.values()], arl)
    shifted = need is not None and len(out) >= max(2, need)
    note = (
        f"latency out on {len(out)} of {len(scored)} calibrated canaries at once: a backend-wide shift"
        if shifted
        else f"latency out on {len(out)} of {len(scored)} calibrated canaries: no drift alone"
        + (f" (a shift needs {max(2, need)})" if need is not None else " (too few canaries to tell)")
    )
    settled = []
    for c in comparisons:
        if c.latency is not None and c.latency.out:
            promote = shifted and not c.verdict.is_drift and c.verdict is not Verdict.ERROR
            c = replace(c, verdict=Verdict.STACK_CHANGE if promote else c.verdict, reasons=(*c.reasons, note))
        settled.append(c)
    return settled


@dataclass(frozen=True, slots=True)
class Decision:
    comparisons: list[Comparison]
    state: DetectorState
    cycle_e: float | None  # the cycle's combined e-value (None: no calibrated canary this cycle)
    out: tuple[str, ...] = field(default=())  # canary ids out this cycle
    # the rules this cycle met, each enough to raise the alarm: "exact" (an exact-regime canary moved a
    # second cycle running), "e-cusum" (the statistic reached arl), "min-out" (min_out canaries out at once)
    raised: tuple[str, ...] = field(default=())


def decide(
    canary_ids: Sequence[str],
    comparisons: Sequence[Comparison],
    state: DetectorState,
    *,
    arl: float,
    min_out: int | None = None,
) -> Decision:
    """Fold one backend cycle into its detector and settle the verdicts of calibrated canaries.

    ``comparisons[i]`` belongs to ``canary_ids[i]``. Only comparisons with evidence from a noise model or a
    two-sample test take part, and each canary counts once: a sampled canary's n draws share one
    evidence, and a chain's steps (``id:step``, whose inputs depend on each other) are one canary, out when
    any step is out, its chance of that bounded by the sum of its steps' (a union bound), its e-value the
    mean of theirs. ``min_out`` None: derived from ``arl`` (`min_out_for`). Only ``conformal-nn`` drift is
    held back as ``within-noise`` (as ``stack-change`` when the stack or prompt tokens moved too); an
    exact-regime change and a sampled canary's two-sample test (already at its own alpha) stand as they
    are. An exact-regime canary raises the alarm when it moves in two
    consecutive cycles with evidence (``state.pending`` carries the first), so one blip cannot latch it.
    Latency is settled on its own first (`latency_shift`).
    """
    comparisons = latency_shift(canary_ids, comparisons, arl)
    steps: dict[str, dict[str, Evidence]] = {}
    for cid, c in zip(canary_ids, comparisons, strict=True):
        if c.evidence is not None and c.evidence.e_value is not None:
            steps.setdefault(cid.partition(":")[0], {}).setdefault(cid, c.evidence)
    if not steps:
        return Decision(list(comparisons), state, None)
    e = cycle_evalue([cycle_evalue([ev.e_value for ev in s.values()]) for s in steps.values()])  # type: ignore[misc]
    m = cusum(state.statistic, e)
    out = tuple(q for q, s in steps.items() if any(ev.out for ev in s.values()))
    exact = tuple(q for q, s in steps.items() if any(ev.out and ev.method == "exact" for ev in s.values()))
    confirmed = set(exact) & set(state.pending)
    if min_out is None:
        bounds = [min(1.0, sum(out_bound(ev) for ev in s.values())) for s in steps.values()]
        min_out = min_out_for(bounds, arl)
    fast = min_out is not None and len(out) >= min_out
    raised = tuple(
        rule for rule, met in (("exact", confirmed), ("e-cusum", m >= arl), ("min-out", fast)) if met
    )
    alarm = state.alarm or bool(raised)
    new_state = DetectorState(m, state.cycles + 1, alarm, exact)
    settled = []
    for c in comparisons:
        ev = c.evidence
        if ev is not None and ev.out and ev.method == "exact" and not alarm:
            c = replace(c, reasons=(*c.reasons, "exact regime: the alarm needs it to move again next cycle"))
        if ev is not None and ev.out and ev.method == "conformal-nn" and c.verdict.is_drift and not alarm:
            needs = (
                f"alarm needs {min_out}" if min_out is not None else "too few canaries to alarm in one cycle"
            )
            why = (
                f"out alone: {len(out)} of {len(steps)} calibrated canaries out ({needs}), "
                f"e-CUSUM {m:.3g} < {arl:g}"
            )
            # a moved stack or prompt is a fact, not a statistic: held back, it is still said
            held = Verdict.STACK_CHANGE if c.stack_changes or c.prompt_tokens_changed else Verdict.NOISE
            c = replace(c, verdict=held, reasons=(why, *c.reasons))
        settled.append(c)
    return Decision(settled, new_state, e, out, raised)
