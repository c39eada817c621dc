"""The reference step of a probe pass: a backend with ``reference = "<name>"`` has its answers re-scored
by that backend (which must be able to score: `canaryd.backends.base.Scorer`).

For each plain canary the provider answered, the reference (1) scores the provider's text on the canary's
prompt by teacher forcing, (2) answers the canary itself, greedily, and scores its own answer the same way,
and (3) does (2) once more: the statistic is how far apart the reference ranks (1) and (2) where they part,
and the same between (2) and (3) is the reference's own noise, the null it is tested against.
Everything goes through the reference's resilience and vetting like any probe. `canaryd.judge.reference`
turns the divergences into a verdict; `apply` writes it into the comparisons once the cycle's other
verdicts are settled. A reference that cannot be reached or cannot
score makes the check an error reason (never an ``identical``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from canaryd.backends import Backend
from canaryd.canaries import Canary
from canaryd.config import Config
from canaryd.judge.compare import Comparison, Verdict
from canaryd.judge.reference import (
    Divergence,
    ReferenceDecision,
    canary_p_value,
    decide,
    divergence,
    parting,
)
from canaryd.observation import Observation, TokenLogprob
from canaryd.probe import vet


@dataclass(frozen=True, slots=True)
class Check:
    """One canary's reference check, or why it could not be made.

    ``divergence``: the provider's answer as the reference scores it; ``own``: the reference's own greedy
    answer, scored the same way (text in, text re-tokenized: whatever that loses, both lose); ``parting``:
    the statistic, how far apart the reference ranks the two where they part (0: the same tokens);
    ``noise``: the same between two of the reference's own answers, one draw of the statistic's null;
    ``gap_noise``: the logprob gap of each of those answers (its generated logprobs against the reference's
    scoring of them), the null of the provider's gap (`judge.reference.canary_p_value`)."""

    divergence: Divergence | None = None
    own: Divergence | None = None
    parting: float | None = None
    noise: float | None = None
    error: str | None = None
    gap_noise: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class Cycle:
    """A backend cycle's reference checks (by canary id) and their decision."""

    reference: str
    checks: dict[str, Check]
    p_values: dict[str, float]
    decision: ReferenceDecision
    floors: dict[str, float] = field(default_factory=dict)  # the provider's noise floor per canary (nats)

    @property
    def max_parting_nats(self) -> float | None:
        """The largest parting this cycle (the backend's metric), None when nothing was scored."""
        values = [c.parting for c in self.checks.values() if c.parting is not None]
        return max(values) if values else None


def checkable(canary: Canary, obs: Observation) -> bool:
    """A plain canary (one generated answer, no tool call) the provider answered with some text."""
    plain = canary.continuation is None and canary.steps is None and canary.conform is None
    return plain and canary.decoding.samples == 1 and obs.ok and bool(obs.text) and obs.tool_calls is None


def scoring(canary: Canary, text: str) -> Canary:
    """The canary as a forced one whose continuation is ``text``: what the reference scores."""
    decoding = canary.decoding.model_copy(update={"top_logprobs": max(1, canary.decoding.top_logprobs)})
    return canary.model_copy(update={"continuation": text, "decoding": decoding})


def _failed(obs: Observation, what: str) -> str:
    return f"{what}: {obs.error_kind}: {obs.error}"


def _own(reference: Backend, canary: Canary) -> tuple[list[TokenLogprob], float | None] | str:
    """The reference's own greedy answer, scored as a provider's would be, and its logprob gap (what it
    generated against that scoring), or why it could not be; an empty answer has no tokens (a provider
    that says something where it says nothing parts from it)."""
    own = vet.probe(reference, canary)
    if not own.ok:
        return _failed(own, "the reference's own answer")
    if not own.text:
        return [], None
    scored = vet.probe(reference, scoring(canary, own.text))
    if not scored.ok:
        return _failed(scored, "scoring its own answer")
    generated = own.tokens if own.has_logprobs else ()
    return scored.tokens, divergence(scored.tokens, generated).logprob_gap


def check_one(reference: Backend, canary: Canary, obs: Observation) -> Check:
    """Score the provider's answer and, twice, the reference's own on the reference; never raises."""
    try:
        scored = vet.probe(reference, scoring(canary, obs.text or ""))
        if not scored.ok:
            return Check(error=_failed(scored, "scoring the answer"))
        first, second = _own(reference, canary), _own(reference, canary)
        for d in (first, second):
            if isinstance(d, str):
                return Check(error=d)
        assert not isinstance(first, str) and not isinstance(second, str)
        (own, own_gap), (repeat, repeat_gap) = first, second
        provider = obs.tokens if obs.has_logprobs else ()
        return Check(
            divergence(scored.tokens, provider),
            divergence(own) if own else None,
            parting(scored.tokens, own),
            parting(own, repeat),
            gap_noise=tuple(g for g in (own_gap, repeat_gap) if g is not None),
        )
    except Exception as e:  # a bug costs this canary's check, reported as such
        return Check(error=f"internal: {e.__class__.__name__}: {str(e)[:200]}")


def run_checks(
    config: Config,
    name: str,
    reference: Backend | None,
    canaries: Sequence[Canary],
    sent: Sequence[list[Observation]],
    floors: Mapping[str, float] | None = None,
) -> Cycle | None:
    """The reference checks of backend ``name``'s cycle on ``reference``, the backend it names (built and
    closed by the pass's caller: the daemon keeps one, with its breaker and stop event, across passes).

    ``floors``: each canary's calibrated noise floor on the provider (`stats.noise_floor`). A parting or
    gap within it, or within ``logprob_tolerance``, is no evidence: the reference's own noise says nothing
    of the provider's (a GPU provider's logprobs wander where a CPU reference's never do), and without
    this floor such a provider serving the claimed weights would be a mismatch in every cycle."""
    ref_name = config.backend(name).reference
    if ref_name is None:
        return None
    todo = [(c, obs[0]) for c, obs in zip(canaries, sent, strict=True) if obs and checkable(c, obs[0])]
    if not todo:  # nothing answered that could be checked: the reference is not called
        return Cycle(ref_name, {}, {}, decide({}, config.compare.alpha))
    if reference is None:  # not built for the pass: not in its config (a pin that leaves it out)
        config.backend(ref_name)  # says so
        raise ValueError(
            f"reference {ref_name!r} is not available to the pass (it failed to build: see the log)"
        )
    with ThreadPoolExecutor(reference.concurrency, thread_name_prefix=f"reference-{name}") as ex:
        checks = list(ex.map(lambda item: check_one(reference, *item), todo))
    by_id = {c.id: check for (c, _), check in zip(todo, checks, strict=True)}
    null = [c.noise for c in by_id.values() if c.noise is not None]
    gap_null = [g for c in by_id.values() for g in c.gap_noise]
    floors = {cid: f for cid, f in (floors or {}).items() if cid in by_id}
    p = {
        cid: canary_p_value(
            c.parting,
            null,
            c.divergence.logprob_gap,
            gap_null,
            max(config.compare.logprob_tolerance, floors.get(cid, 0.0)),
        )
        for cid, c in by_id.items()
        if c.parting is not None and c.divergence is not None
    }
    return Cycle(ref_name, by_id, p, decide(p, config.compare.alpha), floors)


def evidence(cycle: Cycle, canary_id: str) -> dict:
    """What a comparison carries of its canary's reference check (``check --json``, the store)."""
    check = cycle.checks[canary_id]
    return {
        "backend": cycle.reference,
        "divergence": None if check.divergence is None else check.divergence.as_dict(),
        "own_mean_nats": None if check.own is None else check.own.mean_nats,
        "parting_nats": check.parting,
        "noise_nats": check.noise,
        "gap_noise_nats": list(check.gap_noise),
        "provider_noise_nats": cycle.floors.get(canary_id),
        "p_value": cycle.p_values.get(canary_id),
        "cycle_p_value": cycle.decision.p_value,
        "mismatch": canary_id in cycle.decision.out,
        "error": check.error,
    }


def apply(cycle: Cycle | None, canary_id: str, comparison: Comparison) -> Comparison:
    """``comparison`` with its canary's reference check: ``reference-mismatch`` when the canary is out,
    an ``error`` (instead of a verdict that says nothing moved) when the check could not be made."""
    if cycle is None or canary_id not in cycle.checks:
        return comparison
    check, verdict, reasons = cycle.checks[canary_id], comparison.verdict, comparison.reasons
    if check.error is not None:
        reasons = (*reasons, f"reference check on {cycle.reference!r} failed: {check.error}")
        if verdict in (Verdict.IDENTICAL, Verdict.NOISE):
            verdict = Verdict.ERROR
    elif canary_id in cycle.decision.out:
        d = check.divergence
        assert d is not None and check.parting is not None and check.noise is not None
        own = f"{check.own.mean_nats:.4g}" if check.own is not None else "none: it answered nothing"
        gap = ""
        if d.logprob_gap is not None:
            floor = f"{max(check.gap_noise):.3g}" if check.gap_noise else "not measured"
            gap = (
                f"; its logprobs lie {d.logprob_gap:.3g} nats/token from the reference's for the same tokens "
                f"(the reference's own: {floor})"
            )
        reasons = (
            *reasons,
            f"reference {cycle.reference!r} would not answer this: where the answers part it ranks them "
            f"{check.parting:.4g} nats apart (its own two answers: {check.noise:.4g}); the answer scores "
            f"{d.mean_nats:.4g} nats/token off its choices (max {d.max_nats:.4g}, {d.tokens} tokens; its own "
            f"answer {own}){gap}{_floor(cycle, canary_id)}; p = {cycle.p_values[canary_id]:.3g}",
        )
        verdict = Verdict.most_severe([verdict, Verdict.REFERENCE_MISMATCH])
    return replace(comparison, verdict=verdict, reasons=reasons, reference=evidence(cycle, canary_id))


def _floor(cycle: Cycle, canary_id: str) -> str:
    floor = cycle.floors.get(canary_id)
    return f"; beyond this backend's own noise floor of {floor:.3g} nats" if floor else ""


def failed(reference: str, canary_ids: Sequence[str], error: str) -> Cycle:
    """A cycle whose reference step itself failed: every checkable canary carries the error."""
    checks = {cid: Check(error=error) for cid in canary_ids}
    return Cycle(reference, checks, {}, decide({}, 1.0))
