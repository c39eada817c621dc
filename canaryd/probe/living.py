"""Calibration that lives, the probing half: after a pass, refit the models whose noise grew honestly.

The rule is ``canaryd.judge.living``'s; here it meets the backend and the store. Nothing is sent while
every calibrated canary stays within its noise: the pass's own answers are the evidence. Only a canary out
of its noise whose own answer is location-quiet costs ``refit_probes`` more requests, sent alone as the
pass's own answers are (a crowded probe takes the crowd's batch shape, one numerical path, and would not
sample the paths the pass's answers take), and only its refit is saved. Like learning probes they are
never stored as observations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from canaryd import progress
from canaryd.judge.answers import WithAnswers
from canaryd.judge.living import due_refits, refit, restarts_detector
from canaryd.judge.stats import NoiseModel, Point, point
from canaryd.observation import Observation, utcnow
from canaryd.probe.learn import _usable, stored
from canaryd.probe.shapes import Judged, shape_of
from canaryd.stack import configuration_of

if TYPE_CHECKING:
    from canaryd.backends import Backend
    from canaryd.canaries import Canary
    from canaryd.config import CompareConfig
    from canaryd.judge.compare import Comparison, Decision
    from canaryd.store import Store


def refresh(
    backend: Backend,
    canaries: Sequence[Canary],
    judged: Sequence[list[Judged]],
    stack: dict[str, str],
    store: Store,
    settings: CompareConfig,
    decision: Decision,
    bound: Any,
) -> list[list[Judged]]:
    """Refit each calibrated canary of the pass that was out of its noise while its logprobs kept their
    location; the pass's comparisons come back with each refit in its reasons and evidence."""
    if not settings.refit:
        return list(judged)
    # first the pass as it stands: each calibrated answer's location, and the pass's canaries pooled
    reads = store.judging(backend.name)
    answers: list[tuple[Comparison, NoiseModel, Point]] = []
    owners: list[Observation] = []
    for canary, per in zip(canaries, judged, strict=True):
        for j in per if shape_of(canary).calibrated else ():
            ev, obs = j.comparison.evidence, j.observation
            if ev is None or ev.method != "conformal-nn" or not obs.ok:
                continue
            if (model := stored(reads, backend.name, obs)[1]) is None:
                continue
            answers.append((j.comparison, model, point(obs)))
            owners.append(obs)
    quiet, due_at = due_refits(answers)
    if not due_at:
        return list(judged)
    due = {owners[i].canary_id: (answers[i][1], loc, owners[i]) for i, loc in due_at}
    # then the out ones: more probes, and the refit when they keep the location too
    notes: dict[str, str] = {}
    saves: list[tuple[str, str, NoiseModel]] = []
    for canary in canaries:
        mine = {cid: v for cid, v in due.items() if cid.partition(":")[0] == canary.id}
        if not mine:
            continue
        sizes = (1,)  # sent as the pass's own answers are: they sample the noise that judges those
        with progress.quiet():
            probes = shape_of(canary).calibration_probes(
                backend, canary, canaries, k=settings.refit_probes, batch_sizes=sizes
            )
        for cid, (model, loc, own) in mine.items():
            extra = [point(o) for o in _usable(probes.get(cid, []), own, stack)]
            got = refit(model, [point(own), *extra], loc, cap=settings.refit_cap, at=utcnow().isoformat())
            if isinstance(got, str):
                bound.info("refit_refused", canary=cid, why=got)
                continue
            saves.append((cid, configuration_of(own.stack), got))
            notes[cid] = _note(model, got)
    refit_ids = {cid.partition(":")[0] for cid, _, _ in saves}
    restart = restarts_detector(decision.state.alarm, decision.out, refit_ids, quiet)
    for i, (cid, configuration, model) in enumerate(saves):
        last = restart and i == len(saves) - 1  # one restart, with the last refit saved
        entry = (store.calibration(backend.name, cid, configuration) or {}).get("answers")
        saved = model if entry is None else WithAnswers(model, (), entry)  # the learned answers stay
        store.save_calibration(backend.name, cid, saved, configuration, restart_detector=last)
        bound.info("refit", canary=cid, k=model.k, restarts_detector=last)
    return [[_noted(j, notes.get(j.observation.canary_id)) for j in per] for per in judged]


def _note(old: NoiseModel, new: NoiseModel) -> str:
    assert new.refit is not None
    return (
        f"noise model refit #{new.refit.count}: out of its noise, but its logprobs kept their location "
        f"(honest noise grew); {new.k - new.refit.first} references added to the first {new.refit.first}, "
        f"threshold {old.threshold:.3g} -> {new.threshold:.3g}"
    )


def _noted(j: Judged, note: str | None) -> Judged:
    if note is None or j.comparison.evidence is None:
        return j
    ev = j.comparison.evidence
    detail = {**ev.detail, "refit": note}
    c = replace(j.comparison, reasons=(*j.comparison.reasons, note), evidence=replace(ev, detail=detail))
    return replace(j, comparison=c)
