"""Learning by default, the probing half: first contact, and each pass's learning probes.

The rules are ``canaryd.judge.learning``'s; here they meet the backend and the store. Each canary ×
configuration without a noise model for its request gets **first contact** in the pass that finds it so,
before the pass is judged: ``learn_first`` probes through the shape's `calibration_probes` (alone, and
crowded beside filler requests where the backend takes more than one request at a time). Bit-identical with
the pass's own answer: an EXACT model is saved at once (the pass is judged against it). Otherwise a learning
window starts. After the pass is stored, every learning canary whose pass was quiet (no drift, no error)
adds its own answer and ``learn_per_pass`` probes (alone and crowded) to its window; when ``learn_k`` are
in (or ``learn_max_passes`` passes are past, from at least `MIN_FIT` probes) the window is fitted and, if
it launders nothing, saved as the canary's noise model. The window lives in the ``calibration`` table
(`Store.save_learning`), so each ``canaryd check`` process goes on where the last one stopped.

Learning probes are never stored as observations (like calibration probes, they would disturb the
baselines), so a backend's daily budget does not count them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from canaryd import progress
from canaryd.judge import answers, determinism
from canaryd.judge.compare import basis_of
from canaryd.judge.learning import (
    MIN_FIT,
    SHIFT_ALPHA,
    Learning,
    exact,
    is_learning,
    newest_within,
    outside,
    resolvable,
    window_shift_p,
)
from canaryd.judge.stats import CalibrationError, NoiseModel, fit
from canaryd.observation import Observation, tokens_problem
from canaryd.probe.answers import checker
from canaryd.probe.shapes import Judged, shape_of
from canaryd.stack import configuration_of

if TYPE_CHECKING:
    from canaryd.backends import Backend
    from canaryd.canaries import Canary
    from canaryd.config import CompareConfig
    from canaryd.store import Reads, Store

FIRST = "first"  # no model, no window (or one for an older request): first contact is due


def stored(reads: Reads, backend: str, obs: Observation) -> tuple[Learning | None, NoiseModel | None]:
    """The observed id's calibration row, read once: (its learning window, None) or (None, its noise
    model); (None, None) when there is none of the observed request (none, another request's, or one this
    version cannot read)."""
    doc = reads.calibration(backend, obs.canary_id, configuration_of(obs.stack))
    if doc is None:
        return None, None
    try:
        if is_learning(doc):
            state = Learning.from_dict(doc)
            return (state, None) if state.request_hash == obs.request_hash else (None, None)
        model = NoiseModel.from_dict(doc)
    except (CalibrationError, KeyError, TypeError, ValueError):  # unreadable: learning replaces it
        return None, None
    return (None, model) if model.request_hash == obs.request_hash else (None, None)


def _state(reads: Reads, backend: str, obs: Observation) -> Learning | str | None:
    """The observed id's learning window; `FIRST` when first contact is due; None when a model of its
    request is stored (nothing to learn)."""
    window, model = stored(reads, backend, obs)
    if window is not None:
        return window
    return None if model is not None else FIRST


def _sizes(backend: Backend, settings: CompareConfig) -> tuple[int, ...]:
    """The load levels of learning probes: alone, as the pass's own answers are sent (the noise that judges
    them), and one crowded batch, as large as the largest calibration batch size the backend's concurrency
    allows (none where it takes one at a time): a GPU engine's crowded batch takes another numerical path."""
    crowd = min(max(settings.calibration_batch_sizes), backend.concurrency)
    return (1,) if crowd <= 1 else (1, crowd)


def _usable(probes: Sequence[Observation], own: Observation, stack: dict[str, str]) -> list[Observation]:
    """The honest probes of ``own``'s request and serving configuration (a fleet's crowded probe may have
    reached another member), each with the pass's snapshot joined as the pass's own answers have it."""
    out = []
    for o in probes:
        if o.ok and tokens_problem(o.tokens) is None and o.request_hash == own.request_hash:
            o.stack = {**stack, **o.stack}
            if configuration_of(o.stack) == configuration_of(own.stack):
                out.append(o)
    return out


FIRST_ROUNDS = 5  # rounds of first-contact probes, at most, to reach a fleet member's configuration enough


def first_contact(
    backend: Backend,
    canaries: Sequence[Canary],
    sent: Sequence[list[Observation]],
    stack: dict[str, str],
    store: Store,
    settings: CompareConfig,
    bound: Any,
    reached: set[str] | None = None,
    reads: Reads | None = None,
) -> set[str]:
    """First contact for every canary of the pass that is due it (all its answers ok); returns their ids,
    and adds the configurations its probes reached to ``reached``.

    "Exact" needs the evidence of ``own``'s own configuration: at least ``learn_first`` of its probes, one
    crowded among them where the backend takes crowded batches. Behind a balancer a probe may reach
    another member, so up to `FIRST_ROUNDS` rounds are sent; a configuration still short of that learns.
    ``reads``: the pass's, when it has read them already."""
    done: set[str] = set()
    if not settings.learn:
        return done
    reads = store.judging(backend.name) if reads is None else reads
    sizes = _sizes(backend, settings)
    for canary, observations in zip(canaries, sent, strict=True):
        shape = shape_of(canary)
        if not (shape.calibrated and observations and all(o.ok for o in observations)):
            continue
        due = [o for o in observations if _state(reads, backend.name, o) == FIRST]
        if not due:
            continue
        usable: dict[str, dict[int, list[Observation]]] = {o.canary_id: {} for o in due}
        for _ in range(FIRST_ROUNDS):
            for i, size in enumerate(
                sizes
            ):  # split as `calibration_probes` splits k: the first take the rest
                n = settings.learn_first // len(sizes) + (i < settings.learn_first % len(sizes))
                with progress.quiet():  # not the pass's canaries: its progress line counts those
                    probes = shape.calibration_probes(backend, canary, canaries, k=n, batch_sizes=(size,))
                for own in due:
                    got = probes.get(own.canary_id, [])
                    if reached is not None:
                        reached.update(configuration_of({**stack, **o.stack}) for o in got if o.ok)
                    usable[own.canary_id].setdefault(size, []).extend(_usable(got, own, stack))
            if all(_enough(usable[o.canary_id], sizes, settings) for o in due):
                break
        for own in due:
            by_size = usable[own.canary_id]
            probes_of = [o for size in sizes for o in by_size.get(size, [])]
            if _identical_text(own, probes_of) and (more := settings.learn_k - 1 - len(probes_of)) > 0:
                with progress.quiet():
                    extra = shape.calibration_probes(backend, canary, canaries, k=more, batch_sizes=sizes)
                probes_of += _usable(extra.get(own.canary_id, []), own, stack)
            regime = _first(store, backend.name, own, probes_of, settings, _enough(by_size, sizes, settings))
            bound.info("learning_first_contact", canary=own.canary_id, regime=regime)
        done.add(canary.id)
    return done


def _identical_text(own: Observation, usable: list[Observation]) -> bool:
    """Identical answers without logprobs: they do not show an exact backend (an API flipping a quarter of
    its answers gives five identical ones a quarter of the time), so first contact sends ``learn_k``
    probes in all before it decides (`canaryd.judge.answers`)."""
    return bool(usable) and basis_of(own, *usable) == "text" and exact([own, *usable])


def _enough(by_size: dict[int, list[Observation]], sizes: Sequence[int], settings: CompareConfig) -> bool:
    """Whether a configuration's usable probes may call it exact: ``learn_first`` of them, and a crowded
    one where the backend takes crowded batches."""
    total = sum(len(v) for v in by_size.values())
    return total >= settings.learn_first and all(by_size.get(size) for size in sizes[1:])


def _first(
    store: Store,
    backend: str,
    own: Observation,
    usable: list[Observation],
    settings: CompareConfig,
    enough: bool = True,
) -> str:
    configuration = configuration_of(own.stack)
    if not usable:
        return "no probe answered"
    # the pass's own answer opens the window: at a canary's first pass it is the baseline, so the window
    # holds it, and a change after it is a split in time (`window_shift_p`)
    state = Learning.start(own.request_hash, [own, *usable], settings.learn_k, settings.learn_max_passes)
    if enough and exact([own, *usable]):
        model = fit([own, *usable])
        problem = outside_baseline(store, backend, own.canary_id, configuration, model)
        if problem is None:
            saved = answers.WithAnswers(model, state.texts)
            store.save_calibration(backend, own.canary_id, saved, configuration, restart_detector=False)
            return "exact"
        state = replace(state, refused=f"exact at first contact, but {problem}")
    elif (mode := determinism.declared(own.stack)) is not None:  # declared exact: a finding, not learning
        state = replace(state, refused=determinism.not_learned(mode))
    store.save_learning(backend, own.canary_id, configuration, own.request_hash, state.k, state.as_dict())
    return "refused" if state.refused else "learning"


def outside_baseline(
    store: Store, backend: str, canary_id: str, configuration: str, model: NoiseModel
) -> str | None:
    """Why the stored baseline of the model's request lies outside it (None: it does not, or there is none
    to hold it to: no baseline, another request, or unusable logprobs an older version stored, which the
    next pass replaces); the check before a learned or calibrated model is saved."""
    base = store.baseline(backend, canary_id, configuration)
    if base is None or tokens_problem(base.observation.tokens) is not None:
        return None
    if base.observation.request_hash != model.request_hash:
        return None
    return outside(model, base.observation)


def grow(
    backend: Backend,
    canaries: Sequence[Canary],
    judged: Sequence[list[Judged]],
    stack: dict[str, str],
    store: Store,
    settings: CompareConfig,
    skip: set[str],
    bound: Any,
) -> None:
    """Each learning canary's pass (but those of ``skip``, whose first contact was this pass): one more pass
    counted, and when it was quiet its own answer and its learning probes added; a full window is fitted."""
    if not settings.learn:
        return
    reads = store.judging(backend.name)
    for canary, per in zip(canaries, judged, strict=True):
        shape = shape_of(canary)
        if canary.id in skip or not shape.calibrated:
            continue
        states = {}
        for j in per:
            s = _state(reads, backend.name, j.observation) if j.observation.ok else None
            if isinstance(s, Learning) and s.refused is None:
                states[j.observation.canary_id] = (s, j.observation)
        if not states:
            continue
        quiet = all(j.observation.ok and not j.comparison.verdict.is_drift for j in per)
        probes = {}
        if quiet and settings.learn_per_pass:
            sizes = _sizes(backend, settings)
            with progress.quiet():
                probes = shape.calibration_probes(
                    backend, canary, canaries, k=settings.learn_per_pass, batch_sizes=sizes
                )
        for cid, (state, own) in states.items():
            state = replace(state, passes=state.passes + 1)
            added = [own, *_usable(probes.get(cid, []), own, stack)] if quiet else []
            state = state.add(added)
            outcome, why = _settle(store, backend.name, own, state, len(added), settings, checker(canary))
            bound.info("learning", canary=cid, probes=state.k, target=state.target, outcome=outcome, why=why)


def _settle(
    store: Store,
    backend: str,
    own: Observation,
    state: Learning,
    added: int,
    settings: CompareConfig,
    check: answers.Check | None,
) -> tuple[str, str | None]:
    """Fit the window when it is full (or past ``learn_max_passes``) unless its ``added`` newest probes
    are out of the noise before them (it waits a pass), save the model unless it would launder a change
    (``check``: the canary's check of an answer, None where its answers are not checked as text); else
    keep the window. Returns what happened, and why a window was not saved."""
    configuration = configuration_of(own.stack)
    late = state.passes >= settings.learn_max_passes
    due = state.k >= state.target or (late and state.k >= MIN_FIT)
    if due and not late and state.suspect is None and not newest_within(state, added):
        state = replace(state, suspect=state.k - added)  # a change in this very pass? wait to tell
    if due and not late and not resolvable(state):
        due = False
    if due:
        model = state.model()
        problem = outside_baseline(store, backend, own.canary_id, configuration, model)
        if problem is None and (p := window_shift_p(model)) <= SHIFT_ALPHA:
            problem = (
                f"the window's first and second half differ beyond noise (permutation p {p:.3g}): "
                "something changed while learning"
            )
        if problem is None and check is not None:
            problem = answers.window_problem(state.texts, check)
        if problem is None:
            saved = answers.WithAnswers(model, state.texts)
            store.save_calibration(backend, own.canary_id, saved, configuration, restart_detector=False)
            return "fitted", None
        if state.restarts == 0:
            state = Learning(
                state.request_hash, (), (), state.target, restarts=1, max_passes=state.max_passes
            )
        else:
            state = replace(state, refused=problem)
    store.save_learning(backend, own.canary_id, configuration, own.request_hash, state.k, state.as_dict())
    if not due:
        return "learning", None
    return ("refused" if state.refused else "restarted"), problem


def still_learning(store: Store, backend: str, judged: Sequence[Judged]) -> tuple[str, ...]:
    """The canary (and step) ids of the pass whose configuration is still learning (not refused)."""
    reads = store.judging(backend)
    out = []
    for j in judged:
        s = _state(reads, backend, j.observation) if j.observation.ok else None
        if isinstance(s, Learning) and s.refused is None:
            out.append(j.observation.canary_id)
    return tuple(dict.fromkeys(out))
