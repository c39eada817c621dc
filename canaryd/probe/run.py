"""One probe pass: every canary through every backend, each result stored and judged.

Backends run in parallel; within a backend, at most ``concurrency`` canaries are in flight. The stack
snapshot is taken once per backend per pass and joined with each response's own serving facts.

`run_pass` is the one entry, for the commands (`one_pass`) and the daemon alike: its callers build the
backends, the references among them, so that a backend the daemon keeps (its circuit breaker, its stop
event) is the one that answers, whether it is probed or asked as another backend's reference.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import structlog

from canaryd import fleet, progress
from canaryd.backends import Backend, BackendUnavailable, make_backend
from canaryd.backends.base import cannot_score
from canaryd.backends.profile import without_completions
from canaryd.canaries import Canary, Suite, load_suites
from canaryd.config import Config
from canaryd.errors import InputError
from canaryd.judge.compare import Comparison, Decision, Verdict, decide
from canaryd.judge.learning import Learning, is_learning
from canaryd.judge.stats import CalibrationError, DetectorState, NoiseModel, noise_floor
from canaryd.observation import ErrorKind, Observation, storable, utcnow
from canaryd.probe import answers, learn, living, reference, vet
from canaryd.probe.shapes import Judged, shape_of
from canaryd.probe.workers import pulled, workers
from canaryd.stack import configuration_of, merge_stacks, stack_hash
from canaryd.store import Reads, Store, open_store

log = structlog.get_logger("canaryd.probe")


@dataclass(frozen=True, slots=True)
class Result:
    observation_id: int
    run_id: int
    observation: Observation
    comparison: Comparison


@dataclass(frozen=True, slots=True)
class BackendRun:
    """One pass of a backend's canaries, with the stack it showed (snapshot + response facts)."""

    backend: str
    kind: str
    run_id: int
    results: list[Result]
    stack: dict[str, str]  # empty when the backend was down or no probe answered
    unavailable: BackendUnavailable | None = None
    detector: DetectorState | None = None  # the backend's e-CUSUM after this run (as stored)
    reference: reference.Cycle | None = None  # the reference checks of this run, if the backend has one
    learning: tuple[str, ...] = ()  # canary (and step) ids still learning their noise model after it

    @property
    def stack_hash(self) -> str:
        return stack_hash(fleet.hashed(self.stack)) if self.stack else ""


def plan(config: Config, suites: Sequence[Suite], only: str | None = None) -> dict[str, list[Canary]]:
    """Which canaries each backend gets, following each suite's optional ``backends`` list; a raw-prompt
    canary planned for a backend without a completions endpoint is refused here (`InputError`)."""
    out: dict[str, list[Canary]] = {b.name: [] for b in config.backends if only in (None, b.name)}
    for ref, suite in zip(config.suites, suites, strict=True):
        for name in out:
            if ref.backends is None or name in ref.backends:
                out[name].extend(suite.canaries)
    if (why := without_completions(config, suites, only) or cannot_score(config, suites, only)) is not None:
        raise InputError(why)
    return out


def probe_backend(
    backend: Backend,
    canaries: Sequence[Canary],
    store: Store,
    config: Config,
    ref: Backend | None = None,
) -> BackendRun:
    """One backend's share of a pass; ``ref``: the backend it names as its reference, if any."""
    run_id = store.start_run(backend.name)
    bound = log.bind(backend=backend.name, run_id=run_id)
    try:
        stack = vet.storable_fields(backend.snapshot())
        failure = None
    except BackendUnavailable as e:
        stack, failure = {}, e
        bound.warning("backend_unavailable", reason=e.kind.value, error=str(e))

    def one(canary: Canary) -> list[Observation]:
        if failure is not None:  # don't hammer a backend that is down; record why each canary is missing
            return _missing(backend.name, canary, failure.kind, str(failure))
        try:
            return shape_of(canary).send(backend, canary)
        except Exception as e:  # a bug must cost this canary's observations, not the backend's pass
            bound.exception("send_failed", canary=canary.id)
            return _missing(backend.name, canary, ErrorKind.INTERNAL, f"sending failed: {_describe(e)}")

    with workers("probe", backend.concurrency) as ex:
        sent = pulled(ex, progress.counted(one), canaries, backend.concurrency)
    answered = [obs for observations in sent for obs in observations if obs.ok]
    for obs in answered:
        obs.stack = {**stack, **obs.stack}
    reached = {configuration_of(obs.stack) for obs in answered}  # and, below, its first-contact probes'
    reads = _judging(store, backend.name, bound)
    try:  # a canary without a noise model: is its backend exact? (`canaryd.probe.learn`)
        contacted = learn.first_contact(
            backend, canaries, sent, stack, store, config.compare, bound, reached, reads
        )
        wrote = bool(contacted)
    except Exception:  # learning failed: the canaries are judged as they stand, and the pass goes on
        bound.exception("learning_failed")
        contacted, wrote = set(), True  # it may have stored some canaries' first contact before it failed
    if wrote:  # what first contact learned
        reads = _judging(store, backend.name, bound)
    on_fleet = fleet.is_fleet(reached, _known(reads, backend.name, bound))
    for obs in answered:  # whose the snapshot is, on a fleet (`canaryd.fleet`)
        obs.stack = fleet.joined(stack, obs.stack, on_fleet)
    referenced = _reference_checks(config, reads, backend.name, canaries, sent, bound, ref)
    judged = []
    for canary, observations in zip(canaries, sent, strict=True):
        try:
            judged.append(shape_of(canary).judge(reads, config.compare, canary, observations))
        except Exception as e:  # a judging bug: this canary's observations become errors, the pass goes on
            bound.exception("judge_failed", canary=canary.id)
            judged.append([_failed(obs, f"judging failed: {_describe(e)}") for obs in observations])
    judged = _replacement(reads, backend.name, config, canaries, sent, judged, reached, bound)
    judged = answers.settle(store, reads, backend, canaries, judged, config.compare, bound)
    flat = [j for per_canary in judged for j in per_canary]

    # The cycle as a whole: combine the calibrated evidence and carry the backend's detector forward.
    def fold(stored: dict) -> tuple[dict | None, Decision]:
        state = DetectorState.from_dict(stored)
        try:
            d = decide(
                [j.observation.canary_id for j in flat],
                [j.comparison for j in flat],
                state,
                arl=config.compare.arl,
                min_out=config.compare.min_out,
            )
        except Exception:  # the verdicts stand unsettled and the detector as stored
            bound.exception("decide_failed")
            return None, Decision([j.comparison for j in flat], state, None)
        return (d.state.as_dict() if d.cycle_e is not None else None), d

    decision = store.fold_detector(backend.name, fold)
    if decision.cycle_e is not None:
        bound.info(
            "detector",
            cycle_e=round(decision.cycle_e, 4),
            e_cusum=decision.state.statistic,
            alarm=decision.state.alarm,
            out=list(decision.out),
            raised=list(decision.raised),
        )
    # a chain names its first diverged step once the cycle's decision has settled each step's verdict
    settled = iter(decision.comparisons)
    per: list[list[Judged]] = []
    for canary, per_canary in zip(canaries, judged, strict=True):
        steps = [replace(j, comparison=next(settled)) for j in per_canary]
        try:
            steps = shape_of(canary).settle(canary, steps)
        except Exception:  # the steps keep the verdicts the cycle's decision gave them
            bound.exception("settle_failed", canary=canary.id)
        per.append(
            [
                replace(j, comparison=reference.apply(referenced, j.observation.canary_id, j.comparison))
                for j in steps
            ]
        )
    try:  # a calibrated canary whose noise grew without moving is refit (`canaryd.probe.living`)
        per = living.refresh(backend, canaries, per, stack, store, config.compare, decision, bound)
    except Exception:
        bound.exception("refit_failed")
    final = [j for steps in per for j in steps]
    try:  # the learning canaries' windows grow by this pass (before it is stored: its end is the series')
        learn.grow(backend, canaries, per, stack, store, config.compare, contacted, bound)
        learning = learn.still_learning(store, backend.name, final)
    except Exception:
        bound.exception("learning_failed")
        learning = ()
    # one transaction for the pass; an observation the database refuses costs only itself
    items = [(j.observation, j.comparison, j.baseline_id) for j in final]
    written = store.record(run_id, items, len(canaries))
    results = []
    for j, obs_id in zip(final, written, strict=True):
        if isinstance(obs_id, Exception):  # e.g. a value the database refuses: record that, not the value
            bound.error("store_failed", canary=j.observation.canary_id, exc_info=obs_id)
            j = _failed(_stripped(j.observation), f"storing failed: {_describe(obs_id)}")
            obs_id = store.add_observation(run_id, j.observation, j.comparison, None)
        obs, comparison = j.observation, j.comparison
        bound.info(
            "observation",
            canary=obs.canary_id,
            verdict=comparison.verdict.value,
            correct=comparison.correct,
            latency_s=round(obs.latency_s, 4),
            error_kind=obs.error_kind.value if obs.error_kind else None,
        )
        results.append(Result(obs_id, run_id, obs, comparison))
    _report_recording(bound, (store.url, backend.name), [r.comparison for r in results])
    # The run's stack: the snapshot plus every response-level value seen (a fleet may show several).
    # A run where no probe answered has none: a server going down mid-pass answers the snapshot but not
    # the canaries, and that half-stack (no response.* fields) would count as a change, its return as another.
    answered = [r.observation.stack for r in results if r.observation.ok]
    run_stack = merge_stacks([stack, *answered]) if failure is None and answered else {}
    state = decision.state
    return BackendRun(
        backend.name, backend.kind, run_id, results, run_stack, failure, state, referenced, learning
    )


_RECORDING_REPORTED: set[tuple[str, ...]] = set()


def _report_recording(bound: Any, where: tuple[str, str], comparisons: Sequence[Comparison]) -> None:
    """One log line, once per store, backend and process, for the fields this canaryd records differently
    than when the baselines were taken (an upgrade changed its rules): what they are, not a stack change.
    An upgrade restarts the process, so it is the first pass after it that says so."""
    changes = {c.field: (c.before, c.after) for cmp in comparisons for c in cmp.recording_changes}
    key = (*where, *sorted(changes))
    if changes and key not in _RECORDING_REPORTED:
        _RECORDING_REPORTED.add(key)
        bound.info("recording_changed", fields=dict(sorted(changes.items())), stack_change=False)


def _reference_checks(
    config: Config,
    reads: Reads,
    name: str,
    canaries: Sequence[Canary],
    sent: list[list[Observation]],
    bound: Any,
    ref: Backend | None,
) -> reference.Cycle | None:
    """The backend's reference checks (`probe/reference.py`) on ``ref``, if it names a reference; a failure
    of the step itself costs the checks (each answer then carries it as an error reason), never the pass."""
    if config.backend(name).reference is None:
        return None
    try:
        floors = _noise_floors(reads, name, canaries, sent)
        return reference.run_checks(config, name, ref, canaries, sent, floors)
    except Exception as e:
        bound.exception("reference_failed")
        ids = [c.id for c, obs in zip(canaries, sent, strict=True) if obs and reference.checkable(c, obs[0])]
        return reference.failed(config.backend(name).reference or "?", ids, _describe(e))


def _noise_floors(
    reads: Reads, name: str, canaries: Sequence[Canary], sent: list[list[Observation]]
) -> dict[str, float]:
    """Each answered canary's calibrated noise floor on this backend (`stats.noise_floor`): under the
    configuration that answered, else under the latest one calibrated (a provider's noise is more its
    hardware's than one configuration's, and a fleet rotating new ones would otherwise meet a floor of 0);
    a learning canary's is its window's so far (`canaryd.judge.learning`: first contact comes before the
    checks); a canary without a usable calibration or window has none."""
    floors = {}
    for canary, observations in zip(canaries, sent, strict=True):
        if not observations or not observations[0].ok:
            continue
        configuration = configuration_of(observations[0].stack)
        doc = reads.calibration(name, canary.id, configuration) or reads.calibration(name, canary.id)
        if not doc:
            continue
        try:  # a canary still learning has the floor of its window so far
            model = Learning.from_dict(doc).model() if is_learning(doc) else NoiseModel.from_dict(doc)
            floors[canary.id] = noise_floor(model)
        except (CalibrationError, KeyError, TypeError, ValueError):  # the judge reports a refused model
            continue
    return floors


REPLACED = (
    "no configuration this backend had baselines under served this pass: the serving configuration was "
    "replaced, so it is judged against the latest baseline, as one configuration"
)


class _Pooled(Reads):
    """The reads of one baseline per canary × backend (the latest of any configuration): the rule for a
    backend whose configuration was replaced rather than joined by another."""

    def __init__(self, reads: Reads) -> None:
        self._reads = reads

    def baseline(self, backend: str, canary_id: str, configuration: str | None = None):
        return self._reads.baseline(backend, canary_id)

    def baselines(self, backend: str, canary_id: str) -> dict:
        return {}

    def configurations(self, backend: str) -> set[str]:
        return set()

    def calibration(self, backend: str, canary_id: str, configuration: str | None = None):
        return self._reads.calibration(backend, canary_id)

    def run_set(self, observation_id: int) -> list[Observation]:
        return self._reads.run_set(observation_id)


def _judging(store: Store, backend: str, bound: Any) -> Reads:
    """Baselines and calibrations, re-read only when they changed; on a failure each canary reads its own,
    and a failure costs only that canary."""
    try:
        return store.judging(backend)
    except Exception:
        bound.exception("judging_reads_failed")
        return store


def _known(reads: Reads, backend: str, bound: Any) -> set[str]:
    """The configurations the backend has baselines under (none when they cannot be read)."""
    try:
        return set(reads.configurations(backend))
    except Exception:
        bound.exception("configurations_read_failed")
        return set()


def _replacement(
    reads: Reads,
    backend: str,
    config: Config,
    canaries: Sequence[Canary],
    sent: list[list[Observation]],
    judged: list[list[Judged]],
    reached: set[str],
    bound,
) -> list[list[Judged]]:
    """A pass with answers from configurations new to their canaries and nothing from a configuration the
    backend knows, when it knows only one (the only server restarted in another dtype, a provider
    swapped): not a fleet grown by one but a replacement, judged as before configurations (against the
    latest baseline and its calibration), so that a silent change of the only server is still drift.
    ``reached``: the configurations of the pass's answers and first-contact probes; a fleet that gains a
    server keeps answering from the known ones too, and a backend that has shown several configurations
    is a fleet whose pass may reach a newcomer alone: its newcomer is a ``new-configuration``, named as
    the replacement of the known ones nothing reached (`canaryd.fleet.replacing`)."""
    new = [any(j.comparison.verdict is Verdict.NEW_CONFIG for j in per) for per in judged]
    if not any(new):
        return judged
    try:
        known = reads.configurations(backend)
    except Exception:  # the newcomers stay new: a failure here costs no canary
        bound.exception("configurations_read_failed")
        return judged
    if reached & known or len(known) > 1:
        return [[_replaced(j, reached, known) for j in per] for per in judged]
    out = []
    for canary, observations, per, again in zip(canaries, sent, judged, new, strict=True):
        if again:
            try:
                pooled = shape_of(canary).judge(_Pooled(reads), config.compare, canary, observations)
                per = [replace(j, comparison=_noted(j.comparison, REPLACED)) for j in pooled]
            except Exception:  # a judging bug: the canary keeps its first judgement
                bound.exception("judge_failed", canary=canary.id)
        out.append(per)
    return out


def _replaced(j: Judged, reached: set[str], known: set[str]) -> Judged:
    """A newcomer's verdict, naming the known configurations it replaced, if any."""
    if j.comparison.verdict is not Verdict.NEW_CONFIG:
        return j
    why = fleet.replacing(configuration_of(j.observation.stack), reached, known)
    if why is None:
        return j
    return replace(j, comparison=replace(j.comparison, reasons=(*j.comparison.reasons, why)))


def _noted(c: Comparison, why: str) -> Comparison:
    return c if c.verdict is Verdict.ERROR else replace(c, reasons=(why, *c.reasons))


def _describe(e: BaseException) -> str:
    return storable(f"{e.__class__.__name__}: {str(e)[:300]}")


def _missing(backend: str, canary: Canary, kind: ErrorKind, error: str) -> list[Observation]:
    """An error observation for each id the canary is observed under (nothing was sent, or it was lost)."""
    missing = [Observation(backend, i, canary.suite, utcnow(), {}, "") for i in canary.observed_ids()]
    for obs in missing:
        obs.error_kind, obs.error = kind, error
    return missing


def _failed(obs: Observation, error: str) -> Judged:
    """``obs`` as an ``internal`` error (canaryd failed at it, not the backend), judged as one."""
    obs.error_kind, obs.error, obs.tokens = ErrorKind.INTERNAL, error, []
    return Judged(obs, Comparison(Verdict.ERROR, None, reasons=(f"{obs.error_kind}: {error}",)), None)


def _stripped(obs: Observation) -> Observation:
    """What of ``obs`` is safe to store whatever went wrong: its identity, request and timing."""
    return Observation(
        obs.backend,
        obs.canary_id,
        obs.suite,
        obs.started_at,
        obs.request,
        obs.request_hash,
        latency_s=obs.latency_s,
        attempts=obs.attempts,
    )


def run_pass(
    config: Config, backends: Mapping[str, Backend], work: Mapping[str, Sequence[Canary]], store: Store
) -> list[BackendRun]:
    """Probe each backend of ``work`` once, in parallel, store and judge everything; runs come back in
    ``work``'s order. ``backends``: built by the caller, every one of ``work`` and the references they name
    (`built`)."""
    refs = {b: _reference_of(config, backends, b) for b in work}
    if len(work) == 1:  # the daemon's way (a thread of its own per backend already): no second hop
        ((b, canaries),) = work.items()
        return [probe_backend(backends[b], canaries, store, config, refs[b])]
    with workers("backend", max(1, len(work))) as ex:
        futures = [ex.submit(probe_backend, backends[b], w, store, config, refs[b]) for b, w in work.items()]
        return [f.result() for f in futures]


def _reference_of(config: Config, backends: Mapping[str, Backend], name: str) -> Backend | None:
    ref = config.backend(name).reference
    return None if ref is None else backends.get(ref)


@contextmanager
def built(config: Config, names: Iterable[str]) -> Iterator[dict[str, Backend]]:
    """The backends ``names`` and the references they name (those in ``config``), each built once, for
    passes on them; closed at the end."""
    wanted = dict.fromkeys(names)
    known = {b.name for b in config.backends}
    references = set()
    for name in list(wanted):
        ref = config.backend(name).reference
        if ref in known and ref not in wanted:
            wanted[ref] = None
            references.add(ref)
    backends: dict[str, Backend] = {}
    try:
        for name in wanted:
            try:
                backends[name] = make_backend(config.backend(name))
            except Exception as e:
                if name not in references:
                    raise
                # Only the checks it serves fail (`reference.run_checks`), never the pass of its provider.
                log.warning("reference_unavailable", backend=name, error=f"{e.__class__.__name__}: {e}")
        yield backends
    finally:
        for b in backends.values():
            b.close()


def one_pass(config: Config, only: str | None = None) -> list[BackendRun]:
    """A command's pass: load the suites, build every (or one) backend and its reference, probe each once,
    store and judge everything."""
    if only is not None:
        config.backend(only)  # an unknown name is an InputError
    work = plan(config, load_suites([s.path for s in config.suites], config.limits.suite_bytes), only=only)
    progress.begin(sum(map(len, work.values())), ", ".join(work))
    with built(config, work) as backends:
        store = open_store(config)
        try:
            return run_pass(config, backends, work, store)
        finally:
            store.close()
