"""``canaryd baseline calibrate``: measure each canary's honest noise so comparisons can tell it from change.

Each canary is sent K times through its backend, split over the configured load levels: alone, and inside
batches crowded with filler requests (``batching.collect``), because batched engines choose numerical paths
by batch shape. `stats.fit` turns the K probes into the canary's noise model, which the store keeps and
every later comparison uses. A chained canary is run K times in sequence (its steps depend on each
other's outputs) and each step gets its own model; sampled canaries need none (their comparison is a
two-sample test). Calibrating restarts the backend's e-CUSUM detector.

The K probes also give the spread of each canary's reasoning tokens and latency (`stats.SignalFit`), the
calibrated signals of a backend without logprobs. A calibration must not launder a change: when the
canary's baseline (its answer, or its reasoning tokens) lies outside the noise just measured, the stack
moved since the baseline, and that model is not saved (accept the new baseline first, or
investigate). Before it says so, it takes a second look: K more probes, sent alone as a baseline was, and a
model fitted from all 2K. An engine with a few numerical paths can give its baseline one that none of K
probes took (the crowded ones all share the crowd's path), which is no evidence of a move; a baseline
that a move left behind stays outside 2K probes as it did K.

A backend served by several configurations (`canaryd.stack.configuration_of`) is calibrated per
configuration: the K probes are grouped by the configuration that answered them, and each group gets its
own model. A configuration that answered fewer than `MIN_PROBES` of them gets none (and says so): its
canaries are then judged uncalibrated against their own baselines.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from canaryd import progress
from canaryd.backends import Backend
from canaryd.canaries import Canary
from canaryd.config import Config
from canaryd.errors import EXIT_DRIFT, EXIT_OK, EXIT_UNAVAILABLE, InputError
from canaryd.judge.answers import WithAnswers
from canaryd.judge.stats import CalibrationError, NoiseModel, fit
from canaryd.observation import Observation
from canaryd.probe.learn import outside_baseline
from canaryd.probe.shapes import shape_of
from canaryd.stack import configuration_of
from canaryd.store import Store, open_store

MIN_PROBES = 3  # the fewest probes of one configuration a model is fitted from


@dataclass(frozen=True, slots=True)
class Calibrated:
    """The outcome for one canary (or chain step) × backend."""

    backend: str
    canary_id: str
    model: NoiseModel | None
    errors: int
    problem: str | None = None  # why nothing was saved
    configuration: str = ""  # the serving configuration it was measured on ("" none named)

    @property
    def unavailable(self) -> bool:
        """Nothing to fit because the backend failed the probes (not because the stack moved)."""
        return self.model is None and self.errors > 0

    def as_dict(self) -> dict:
        return {
            "backend": self.backend,
            "canary": self.canary_id,
            "configuration": self.configuration,
            "saved": self.problem is None,
            "problem": self.problem,
            "errors": self.errors,
            **(self.model.summary() if self.model else {}),
        }


def calibrate(
    backend: Backend,
    canaries: Sequence[Canary],
    store: Store,
    *,
    k: int,
    batch_sizes: Sequence[int],
    others: Sequence[Canary] | None = None,
) -> list[Calibrated]:
    """Calibrate every non-sampled canary of one backend and save the models that pass the checks.
    Fillers for the crowded batches come from ``others`` (the backend's whole suite; default ``canaries``)."""
    out = []
    crowd = canaries if others is None else others
    for canary in progress.each(canaries):
        shape = shape_of(canary)
        if not shape.calibrated:
            continue
        probes = shape.calibration_probes(backend, canary, crowd, k=k, batch_sizes=batch_sizes)
        for cid, observed in probes.items():
            done = _fit_each(backend.name, cid, observed, store)
            if any(r.model is not None and r.problem for r in done):  # a second look, alone
                again = shape.calibration_probes(backend, canary, crowd, k=k, batch_sizes=(1,))
                done = _fit_each(backend.name, cid, observed + again.get(cid, []), store)
            out.extend(done)
    return out


def _fit_each(backend: str, cid: str, observed: list[Observation], store: Store) -> list[Calibrated]:
    """A model per serving configuration that answered the K probes (failed probes count as errors of
    each). One configuration: as before, whatever the count."""
    errors = sum(not o.ok for o in observed)
    groups: dict[str, list[Observation]] = {}
    for o in observed:
        if o.ok:
            groups.setdefault(configuration_of(o.stack), []).append(o)
    if len(groups) <= 1:
        only = next(iter(groups), "")
        return [_fit_one(backend, cid, observed, store, only, errors)]
    out = []
    for configuration, group in sorted(groups.items()):
        if len(group) < MIN_PROBES:
            why = (
                f"configuration {configuration or '(none)'} answered {len(group)} of {len(observed)} "
                f"probes (fewer than {MIN_PROBES}): not calibrated"
            )
            out.append(Calibrated(backend, cid, None, errors, why, configuration))
            continue
        out.append(_fit_one(backend, cid, group, store, configuration, errors))
    return out


def _fit_one(
    backend: str, cid: str, observed: list[Observation], store: Store, configuration: str, errors: int
) -> Calibrated:
    try:
        model = fit(observed)
    except CalibrationError as e:
        return Calibrated(backend, cid, None, errors, str(e), configuration)
    problem = outside_baseline(store, backend, cid, configuration, model)
    if problem is None:
        texts = tuple(o.text or "" for o in observed if o.ok)
        store.save_calibration(backend, cid, WithAnswers(model, texts), configuration)
    return Calibrated(backend, cid, model, errors, problem, configuration)


@dataclass(frozen=True, slots=True)
class CalibrationReport:
    """``canaryd baseline calibrate``: each canary's outcome, and the backends that could not be reached."""

    results: tuple[Calibrated, ...]
    unavailable: dict[str, str]  # backend → why it was unreachable

    @property
    def problems(self) -> list[Calibrated]:
        """Outcomes with a reason nothing was saved."""
        return [r for r in self.results if r.problem]

    @property
    def exit_code(self) -> int:
        """3 when a backend was unreachable or failed the probes, else 1 when a model was not saved."""
        if self.unavailable or any(r.unavailable for r in self.results):
            return EXIT_UNAVAILABLE
        return EXIT_DRIFT if self.problems else EXIT_OK

    def as_dict(self) -> dict:
        """The ``baseline calibrate --json`` document."""
        return {"exit_code": self.exit_code, "calibrations": [r.as_dict() for r in self.results]}


def calibrate_config(
    config: Config,
    *,
    backend: str | None = None,
    canary_ids: Sequence[str] | None = None,
    k: int | None = None,
    batch_sizes: Sequence[int] | None = None,
) -> CalibrationReport:
    """`calibrate` each (or one) backend's calibrated canaries (``canary_ids``: only these), with ``k``
    probes each over ``batch_sizes`` (defaults: ``[compare] calibration_k`` and
    ``calibration_batch_sizes``). An unknown or sampled canary, or ``k`` outside 2..1000, is an
    `InputError`; an unreachable backend is reported in ``unavailable`` and the others go on."""
    from canaryd.backends import BackendUnavailable, make_backend
    from canaryd.canaries import load_suites
    from canaryd.probe.run import plan

    if backend is not None:
        config.backend(backend)  # an unknown name is an InputError
    sizes = tuple(config.compare.calibration_batch_sizes if batch_sizes is None else batch_sizes)
    k = config.compare.calibration_k if k is None else k
    if not 2 <= k <= 1000:
        raise InputError(f"-k: {k} is not from 2 to 1000")
    work = plan(config, load_suites([s.path for s in config.suites], config.limits.suite_bytes), only=backend)
    known = {c.id: c for cs in work.values() for c in cs}
    for cid in canary_ids or ():
        if cid not in known:
            raise InputError(f"--canary: unknown canary {cid!r} (not in the suites of the chosen backends)")
        if not shape_of(known[cid]).calibrated:
            raise InputError(
                f"--canary: {cid!r} is a sampled canary; its two-sample test needs no calibration"
            )
    results: list[Calibrated] = []
    unavailable: dict[str, str] = {}
    store = open_store(config)
    try:
        for name, canaries in work.items():
            chosen = [c for c in canaries if not canary_ids or c.id in canary_ids]
            progress.begin(len(chosen), name)
            # crowded batches put max(sizes) requests in flight, beyond the backend's usual concurrency
            bcfg = config.backend(name)
            b = make_backend(bcfg.model_copy(update={"concurrency": max(bcfg.concurrency, *sizes)}))
            try:
                b.snapshot()
                results.extend(calibrate(b, chosen, store, k=k, batch_sizes=sizes, others=canaries))
            except BackendUnavailable as e:
                unavailable[name] = str(e)
            finally:
                b.close()
    finally:
        store.close()
    return CalibrationReport(tuple(results), unavailable)
