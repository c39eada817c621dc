"""Chained canaries: a multi-step plan (extract the terms → map the facts → answer) sent step by step.

Each step is sent as a plain canary whose text has its ``{{step_id}}`` references filled in with the
outputs of earlier steps, and each becomes an observation of its own, ``canary_id`` ``"<canary>:<step>"``
(':' cannot occur in an id), with its own baseline. A step's ``request_hash`` is the backend's hash of the
step's *template* (unrendered text, decoding, model), not of the rendered request: baselines are keyed by
request hash, and an upstream step whose output moved must show as a change of this step, never as a new
baseline. The stored ``request`` is still the exact rendered request sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from canaryd.backends import Backend
from canaryd.canaries import STEP_REF, Canary, Message, Step
from canaryd.judge.compare import Comparison, Verdict
from canaryd.observation import Observation, utcnow
from canaryd.probe import vet

# A step "diverged" when its own output moved: any drift verdict but a stack change, which (like noise)
# moved nothing it said.
DIVERGED = frozenset(v for v in Verdict if v.is_drift) - {Verdict.STACK_CHANGE}


def render(text: str, outputs: dict[str, str]) -> str:
    """``text`` with each ``{{step_id}}`` replaced by that step's output."""
    return STEP_REF.sub(lambda ref: outputs[ref.group(1)], text)


def step_canary(canary: Canary, step: Step, outputs: dict[str, str] | None = None) -> Canary:
    """The step as a plain canary, rendered with ``outputs`` (or left as its template when None)."""

    def fill(text: str) -> str:
        return text if outputs is None else render(text, outputs)

    return Canary(
        id=canary.id,
        suite=canary.suite,
        messages=None
        if step.messages is None
        else tuple(Message(role=m.role, content=fill(m.content)) for m in step.messages),
        prompt=None if step.prompt is None else fill(step.prompt),
        decoding=canary.step_decoding(step),
    )


def run_chain(backend: Backend, canary: Canary) -> list[Observation]:
    """Send the steps in order, one observation each; after a failed step the rest are errors, not sent."""
    outputs: dict[str, str] = {}
    failed: Observation | None = None
    observations = []
    for step, observed_id in zip(canary.steps or (), canary.observed_ids(), strict=True):
        if failed is None:
            obs = vet.probe(backend, step_canary(canary, step, outputs))
            obs.request_hash = backend.request_hash(step_canary(canary, step))
        else:
            obs = Observation(backend.name, observed_id, canary.suite, utcnow(), {}, "", attempts=0)
            obs.error_kind = failed.error_kind
            obs.error = f"not sent: step {failed.canary_id!r} failed ({failed.error_kind})"
        obs.canary_id = observed_id
        if obs.ok:
            outputs[step.id] = obs.text or ""
        elif failed is None:
            failed = obs
        observations.append(obs)
    return observations


@dataclass(frozen=True, slots=True)
class Divergence:
    """The first step of a chain whose output moved from its baseline."""

    step: str
    position: int  # 1-based
    steps: int

    @property
    def reason(self) -> str:
        return f"step {self.step!r} ({self.position} of {self.steps}) diverged first"


def first_divergence(steps: Sequence[tuple[str, Comparison]]) -> Divergence | None:
    """Given (step id, comparison) in plan order, the first step that diverged; None when none did."""
    for i, (step_id, comparison) in enumerate(steps):
        if comparison.verdict in DIVERGED:
            return Divergence(step_id, i + 1, len(steps))
    return None


def mark_divergence(
    canary: Canary, judged: list[tuple[Observation, Comparison, int | None]]
) -> list[tuple[Observation, Comparison, int | None]]:
    """The judged steps, the final one's comparison naming the first diverging step (if any)."""
    found = first_divergence([(s.id, c) for s, (_, c, _) in zip(canary.steps or (), judged, strict=True)])
    if found is None:
        return judged
    obs, comparison, baseline_id = judged[-1]
    final = replace(comparison, first_diverged_step=found.step, reasons=(*comparison.reasons, found.reason))
    return [*judged[:-1], (obs, final, baseline_id)]
