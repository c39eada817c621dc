"""Deterministic modes are watched: a backend whose stack declares it exact is held to it.

vLLM's batch invariance (``VLLM_BATCH_INVARIANT=1`` in the server's environment, ``env.*``) and SGLang's
deterministic inference (``--enable-deterministic-inference``, ``engine.enable_deterministic_inference``
from ``/server_info``) promise bit-identical answers whatever the batch. Users turn them on because they
need that, and both have known gaps, so a canary on such a backend is never *learning*
(`canaryd.judge.learning`): its first non-exact answer is the verdict ``determinism-broken`` (drift),
with the mode and its gaps in the reason:

* at first contact, when the probes (alone and crowded) are not all bit-identical with the pass's answer:
  first contact keeps them as a refused window (`not_learned`), and every pass judged while it stands is
  ``determinism-broken``: one identical answer does not restore a promise the probes broke;
* later, when an answer leaves the canary's exact model (what first contact saved when the probes agreed):
  the one-probe ``logprob-drift`` or ``answer-drift`` becomes ``determinism-broken``. A changed model
  moves an exact answer too; the reason says both.

A wrong answer (``regression``) and a reference mismatch stay as they are: they say more. ``baseline
calibrate`` measures the noise and accepts it (a calibrated model is no exact one); ``baseline accept``
drops the window, and first contact decides again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from canaryd.judge.compare import Comparison, Verdict
from canaryd.judge.learning import Learning, is_learning
from canaryd.judge.stats import Point
from canaryd.observation import Observation

__all__ = ["Mode", "declared", "not_learned", "watch"]


@dataclass(frozen=True, slots=True)
class Mode:
    """A deterministic mode a stack declares: the field and value that say so, and its known gaps."""

    name: str
    field: str
    value: str
    gaps: str

    def __str__(self) -> str:
        return f"{self.name} ({self.field}={self.value})"


VLLM_FIELD = "env.VLLM_BATCH_INVARIANT"
SGLANG_FIELD = "engine.enable_deterministic_inference"
VLLM_GAPS = (
    "known gaps: batch invariance is beta, does not cover GDN attention (Qwen3.5-style hybrid models, "
    "vllm#42960) nor TP all-reduces that are not a multiple of 16 bytes, and left a 6.7e-2 nat residual "
    "(vllm PR #32480)"
)
SGLANG_GAPS = (
    "known gaps: deterministic MoE held at TP 2 and failed at TP >= 4 (sglang#10785); "
    "Kimi-K2.5 moved despite the flag (sglang#25912)"
)
MOVED = (Verdict.ANSWER_DRIFT, Verdict.LOGPROB_DRIFT)
WHAT_NOW = "`baseline calibrate` accepts this noise; `baseline accept` decides again by first contact"


def _on(value: str) -> bool:
    """vLLM reads the variable as an integer (``bool(int(...))``): any non-zero one turns it on."""
    try:
        return int(value.strip()) != 0
    except ValueError:
        return False


def declared(stack: Mapping[str, str]) -> Mode | None:
    """The deterministic mode the stack declares, if any."""
    if _on(v := stack.get(VLLM_FIELD, "")):
        return Mode("vLLM batch invariance", VLLM_FIELD, v, VLLM_GAPS)
    if stack.get(SGLANG_FIELD, "") == "true":
        tp = stack.get("engine.tp_size")
        gaps = SGLANG_GAPS + (f"; this server runs tp_size {tp}" if tp else "")
        return Mode("SGLang deterministic inference", SGLANG_FIELD, "true", gaps)
    return None


def not_learned(mode: Mode) -> str:
    """Why first contact refuses to learn a non-exact canary of a deterministic backend."""
    return f"{mode} declares this backend exact: it is held to exactness, not learned ({WHAT_NOW})"


def _differences(points: Sequence[Point]) -> str:
    """How the window's probes differ from its first (the answer of the pass that made first contact)."""
    first, rest = points[0], points[1:]
    differ = sum(p.signature != first.signature for p in rest)
    texts = sum(p.ids != first.ids for p in rest)
    moved = [abs(p.coords[k] - first.coords[k]) for p in rest for k in p.coords.keys() & first.coords.keys()]
    how = f"max |Δ logprob| {max(moved, default=0.0):.3g}"
    if texts:
        how += f", {texts} with other tokens"
    return f"{differ} of its {len(rest)} first-contact probes (alone, crowded) differ from its answer ({how})"


def watch(c: Comparison, obs: Observation, doc: Mapping | None) -> Comparison:
    """``c`` as ``determinism-broken`` when ``obs``'s stack declares a deterministic mode and the canary
    has shown it is not exact: its stored window (``doc``, the calibration row of its configuration) holds
    probes that differ, or ``c`` is a one-probe drift from an exact model. Otherwise ``c`` unchanged."""
    mode = declared(obs.stack) if obs.ok else None
    if mode is None or c.verdict.rank <= Verdict.DETERMINISM_BROKEN.rank:
        return c
    why = None
    if is_learning(doc):
        try:
            state = Learning.from_dict(doc)  # type: ignore[arg-type]
        except (KeyError, TypeError, ValueError):  # the judge reports an unreadable row
            return c
        if state.request_hash == obs.request_hash and len({p.signature for p in state.points}) > 1:
            why = _differences(state.points)
    elif c.verdict in MOVED and c.evidence is not None and c.evidence.method == "exact" and c.evidence.out:
        why = "this answer left the exact model its first-contact probes agreed on (or the model changed)"
    if why is None:
        return c
    reason = f"determinism broken: {mode} declares this backend exact, but {why}; {mode.gaps}; {WHAT_NOW}"
    return replace(c, verdict=Verdict.DETERMINISM_BROKEN, reasons=(reason, *c.reasons))
