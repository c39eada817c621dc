"""Answers that flip, the pass's half: each plain canary's answer judged on its learned answers.

The rules are ``canaryd.judge.answers``'s; here they meet the store. After a pass is judged and before the
cycle is decided, every answer of a plain canary with a known answer is judged against what its
calibration row learned: a learning window's texts so far, or a fitted model's ``answers`` entry and the
answers of the passes since it was fitted (the last ``max(WINDOWS)`` stored observations of the canary ×
backend × serving configuration, read from the observation table: no state of its own).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import datetime
from typing import TYPE_CHECKING, Any

from canaryd import progress
from canaryd.canaries import Canary, CheckTimeout
from canaryd.judge import answers
from canaryd.judge.learning import Learning, is_learning
from canaryd.judge.verdicts import Verdict
from canaryd.observation import Observation
from canaryd.probe.shapes import shape_of
from canaryd.stack import configuration_of

if TYPE_CHECKING:
    from canaryd.backends import Backend
    from canaryd.config import CompareConfig
    from canaryd.probe.shapes import Judged
    from canaryd.store import Reads, Store


def _judged_on_text(canary: Canary) -> bool:
    """A greedy plain canary whose answer is checked as text (no tool call, no forced continuation)."""
    e = canary.expect
    return (
        e is not None
        and e.tool_call is None
        and canary.continuation is None
        and canary.decoding.temperature == 0
        and canary.conform is None
        and canary.steps is None
    )


def checker(canary: Canary) -> answers.Check | None:
    """The canary's check of a text, remembered per text (a pass checks a few texts many times); None
    where its answers are not checked as text."""
    if not _judged_on_text(canary):
        return None
    seen: dict[str, bool | None] = {}

    def check(text: str) -> bool | None:
        if text not in seen:
            try:
                seen[text] = canary.expect.check(text)  # type: ignore[union-attr]
            except CheckTimeout:
                seen[text] = None
        return seen[text]

    return check


def settle(
    store: Store,
    reads: Reads,
    backend: Backend,
    canaries: Sequence[Canary],
    judged: list[list[Judged]],
    settings: CompareConfig,
    bound: Any,
) -> list[list[Judged]]:
    """Each text-checked canary's answer judged on its learned answers (a failure leaves it as it was)."""
    out = []
    for canary, per in zip(canaries, judged, strict=True):
        if (check := checker(canary)) is not None:
            again = _asker(backend, canary, canaries, settings.learn_first)
            try:
                per = [_one(store, reads, backend.name, check, again, j) for j in per]
            except Exception:
                bound.exception("answers_failed", canary=canary.id)
        out.append(per)
    return out


def _asker(
    backend: Backend, canary: Canary, canaries: Sequence[Canary], k: int
) -> Callable[[Observation], list[str]]:
    """What asks an observation's request ``k`` more times, alone, for the texts its configuration gave."""

    def again(obs: Observation) -> list[str]:
        with progress.quiet():  # not the pass's canaries: its progress line counts those
            probes = shape_of(canary).calibration_probes(backend, canary, canaries, k=k, batch_sizes=(1,))
        same = configuration_of(obs.stack)
        return [
            o.text or ""
            for o in probes.get(obs.canary_id, [])
            if o.ok
            and o.request_hash == obs.request_hash
            and configuration_of({**obs.stack, **o.stack}) == same
        ]

    return again


def _one(
    store: Store,
    reads: Reads,
    backend: str,
    check: answers.Check,
    again: Callable[[Observation], list[str]],
    j: Judged,
) -> Judged:
    obs = j.observation
    if not obs.ok:
        return j
    configuration = configuration_of(obs.stack)
    doc = reads.calibration(backend, obs.canary_id, configuration)
    if is_learning(doc):
        state = Learning.from_dict(doc)  # type: ignore[arg-type]
        if state.request_hash != obs.request_hash or state.refused is not None:
            return j
        first = j.comparison.verdict is Verdict.REGRESSION and not any(check(t) is False for t in state.texts)
        asked = again(obs) if first else ()
        c = answers.while_learning(j.comparison, state.texts, check, state.reason(), state.evidence(), asked)
        return replace(j, comparison=c)
    found = answers.learned(doc)
    if found is None or doc["request_hash"] != obs.request_hash:  # type: ignore[index]
        return j
    texts, since = found
    if not answers.varies(texts, check):
        return j
    recent = [(obs.text or "", True), *_since(store, backend, obs, configuration, since)]
    return replace(j, comparison=answers.judge(j.comparison, texts, recent, check))


def _since(
    store: Store, backend: str, obs: Observation, configuration: str, since: datetime
) -> list[tuple[str, bool]]:
    """The canary's stored answers under this configuration and request since ``since``, newest first,
    each with whether it was judged without drift (at most ``max(WINDOWS) + HISTORY - 1``)."""
    need = max(answers.WINDOWS) + answers.HISTORY - 1
    rows = store.observations(backend=backend, canary_id=obs.canary_id, limit=2 * need)
    rows = [
        r
        for r in rows
        if r.error_kind is None and r.request_hash == obs.request_hash and answers.aware(r.started_at) > since
    ]
    if not rows:
        return []
    full = {o.id: full for o, full in store.load([r.id for r in rows])}
    kept = [
        (r.text or "", not Verdict(r.verdict).is_drift)
        for r in rows
        if configuration_of(full[r.id].stack) == configuration
    ]
    return kept[:need]
