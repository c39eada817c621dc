"""One probe pass: every canary through every backend, each result stored and judged.

Backends run in parallel; within a backend, at most ``concurrency`` canaries are in flight. The stack
snapshot is taken once per backend per pass and joined with each response's own serving facts.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import structlog

from canaryd.backends import Backend, BackendUnavailable, make_backend
from canaryd.canaries import Canary, Suite, load_suites
from canaryd.compare import Comparison, compare
from canaryd.config import Config
from canaryd.observation import Observation
from canaryd.stack import merge_stacks, stack_hash
from canaryd.store import Store, utcnow

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
    stack: dict[str, str]
    unavailable: BackendUnavailable | None = None

    @property
    def stack_hash(self) -> str:
        return stack_hash(self.stack) if self.stack else ""


def plan(config: Config, suites: Sequence[Suite], only: str | None = None) -> dict[str, list[Canary]]:
    """Which canaries each backend gets, following each suite's optional ``backends`` list."""
    out: dict[str, list[Canary]] = {b.name: [] for b in config.backends if only in (None, b.name)}
    for ref, suite in zip(config.suites, suites, strict=True):
        for name in out:
            if ref.backends is None or name in ref.backends:
                out[name].extend(suite.canaries)
    return out


def probe_backend(backend: Backend, canaries: Sequence[Canary], store: Store, config: Config) -> BackendRun:
    run_id = store.start_run(backend.name)
    bound = log.bind(backend=backend.name, run_id=run_id)
    try:
        stack = backend.snapshot()
        failure = None
    except BackendUnavailable as e:
        stack, failure = {}, e
        bound.warning("backend_unavailable", reason=e.kind.value, error=str(e))

    def one(canary: Canary) -> Observation:
        if failure is not None:  # don't hammer a backend that is down; record why each canary is missing
            obs = Observation(backend.name, canary.id, canary.suite, utcnow(), {}, "")
            obs.error_kind, obs.error = failure.kind, str(failure)
            return obs
        return backend.probe(canary)

    with ThreadPoolExecutor(
        max_workers=backend.concurrency, thread_name_prefix=f"probe-{backend.name}"
    ) as ex:
        observations = list(ex.map(one, canaries))

    results = []
    for canary, obs in zip(canaries, observations, strict=True):
        if obs.ok:
            obs.stack = {**stack, **obs.stack}
        base = store.baseline(backend.name, canary.id)
        correct = canary.expect.check(obs.text or "") if canary.expect and obs.ok else None
        comparison = compare(
            base[1] if base else None,
            obs,
            correct=correct,
            baseline_correct=base[2] if base else None,
            logprob_tolerance=config.compare.logprob_tolerance,
        )
        obs_id = store.add_observation(run_id, obs, comparison, base[0] if base else None)
        bound.info(
            "observation",
            canary=canary.id,
            verdict=comparison.verdict.value,
            correct=correct,
            latency_s=round(obs.latency_s, 4),
            error_kind=obs.error_kind.value if obs.error_kind else None,
        )
        results.append(Result(obs_id, run_id, obs, comparison))
    store.finish_run(run_id, len(canaries))
    # The run's stack: the snapshot plus every response-level value seen (a fleet may show several).
    run_stack = (
        merge_stacks([stack, *(r.observation.stack for r in results if r.observation.ok)])
        if failure is None
        else {}
    )
    return BackendRun(backend.name, backend.kind, run_id, results, run_stack, failure)


def probe_all(
    backends: Sequence[Backend], work: dict[str, list[Canary]], store: Store, config: Config
) -> list[BackendRun]:
    """Probe all backends in parallel; runs come back in config order."""
    with ThreadPoolExecutor(max_workers=max(1, len(backends)), thread_name_prefix="backend") as ex:
        futures = [ex.submit(probe_backend, b, work[b.name], store, config) for b in backends]
        return [f.result() for f in futures]


def run_pass(config: Config, only: str | None = None) -> list[Result]:
    """Load the suites, probe every (or one) backend once, store and judge everything."""
    if only is not None:
        config.backend(only)  # an unknown name is an InputError
    work = plan(config, load_suites([s.path for s in config.suites]), only=only)
    backends = [make_backend(config.backend(name)) for name in work]
    store = Store(config.storage_url, instance=config.daemon.instance)
    try:
        return [r for run in probe_all(backends, work, store, config) for r in run.results]
    finally:
        for b in backends:
            b.close()
        store.close()
