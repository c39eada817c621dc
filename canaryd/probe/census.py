"""The nondeterminism census: one canary sent N times, alone and inside crowded batches; what varies?

"Same prompt, same weights, temperature 0" gives one answer only on a batch-invariant engine: elsewhere the
result depends on what else shared the batch (Thinking Machines: 1,000 identical greedy requests to
Qwen3-235B gave 80 distinct completions). The census measures this from outside, per canary × backend:

* `canaryd.probe.batching.collect` sends ``n`` probes of the canary for each batch size ``b``: at ``b = 1``
  one after another; at ``b > 1`` each probe is released together with ``b − 1`` filler requests (other
  prompts, same decoding: `canaryd.probe.shapes.fillers_for`), so the engine batches them with it. Filler
  answers are thrown away.
* `canaryd.judge.census` summarizes what varied: distinct completions and signatures, where probes first
  left the modal completion, the per-position logprob spread; whether the canary is deterministic and
  batch-invariant.

Nothing here touches the history: census probes would disturb the baselines. ``canaryd baseline
calibrate`` sends its probes the same way.

A backend whose kind serialises its probes (concurrency 1) never batches its fillers with the canary.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from canaryd import progress
from canaryd.backends import Backend
from canaryd.canaries import Canary
from canaryd.config import Config
from canaryd.errors import EXIT_DRIFT, EXIT_OK, EXIT_UNAVAILABLE, InputError
from canaryd.judge.census import Census, summarize
from canaryd.probe.batching import collect
from canaryd.probe.shapes import fillers_for, shape_of

MAX_BATCH = 256  # the most requests a census puts in flight at once (BackendConfig.concurrency's bound)


def parse_batch_sizes(value: str) -> tuple[int, ...]:
    """``"1,8,32"`` → ``(1, 8, 32)``: distinct positive integers up to `MAX_BATCH`, in the given order."""
    sizes: list[int] = []
    for part in value.split(","):
        part = part.strip()
        if not part.isdigit() or not 1 <= int(part) <= MAX_BATCH:
            raise InputError(
                f"--batch-sizes: {part!r} is not an integer from 1 to {MAX_BATCH} (e.g. --batch-sizes 1,8,32)"
            )
        if int(part) not in sizes:
            sizes.append(int(part))
    return tuple(sizes)


def run_census(
    backend: Backend, canary: Canary, *, n: int, batch_sizes: Sequence[int], fillers: Sequence[Canary]
) -> Census:
    """`collect` then `summarize` each batch size."""
    observed = collect(backend, canary, n=n, batch_sizes=batch_sizes, fillers=fillers)
    return Census(backend.name, canary.id, {b: summarize(obs) for b, obs in observed.items()})


# -- the census of a config ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CensusReport:
    """``canaryd census``: each canary × backend's `Census`, and what could not be measured."""

    requests: int
    batch_sizes: tuple[int, ...]
    censuses: tuple[Census, ...]
    wall_s: tuple[float, ...]  # each census's wall time, in the order of ``censuses``
    stacks: dict[str, str]  # backend → the stack hash it showed at the start
    unavailable: dict[str, str]  # backend → why it was unreachable
    strict: bool = False  # a canary that is not deterministic or not batch-invariant fails (exit 1)

    @property
    def incomplete(self) -> list[Census]:
        """Censuses where every probe of some batch size failed."""
        return [c for c in self.censuses if not c.complete]

    @property
    def exit_code(self) -> int:
        if self.unavailable or self.incomplete:
            return EXIT_UNAVAILABLE
        if self.strict and any(False in (c.deterministic, c.batch_invariant) for c in self.censuses):
            return EXIT_DRIFT
        return EXIT_OK

    def as_dict(self) -> dict:
        """The ``census --json`` document (and ``--output`` file)."""
        return {
            "exit_code": self.exit_code,
            "requests": self.requests,
            "batch_sizes": list(self.batch_sizes),
            "stacks": self.stacks,
            "unavailable": self.unavailable,
            "censuses": [
                {**c.as_dict(), "wall_s": round(t, 3)}
                for c, t in zip(self.censuses, self.wall_s, strict=True)
            ],
        }


def take_census(
    config: Config,
    *,
    backend: str | None = None,
    canary_ids: Sequence[str] | None = None,
    requests: int = 20,
    sizes: Sequence[int] = (1, 8, 32),
    strict: bool = False,
) -> CensusReport:
    """`run_census` for each chosen single-request canary of each (or one) backend; nothing is stored.

    ``canary_ids`` narrows the canaries (default: all); an unknown one, or one of several requests per probe
    (chained, conformance), is an `InputError`.
    Each backend is built with room for ``max(sizes)`` requests in flight; one that is unreachable is
    reported in ``unavailable`` and the census goes on with the others.
    """
    from canaryd.backends import BackendUnavailable, make_backend
    from canaryd.canaries import load_suites
    from canaryd.probe.run import plan
    from canaryd.stack import stack_hash

    if backend is not None:
        config.backend(backend)  # an unknown name is an InputError
    planned = plan(
        config, load_suites([s.path for s in config.suites], config.limits.suite_bytes), only=backend
    )
    # one request per probe: a chained canary's steps depend on each other's outputs, a conformance pair's
    # sides differ on purpose, so both are left out
    work = {b: [c for c in cs if shape_of(c).single_request] for b, cs in planned.items()}
    several = {c.id: s.name for cs in planned.values() for c in cs if not (s := shape_of(c)).single_request}
    known = {c.id for cs in work.values() for c in cs}
    for cid in canary_ids or ():
        if cid in several:
            raise InputError(
                f"--canary: {cid!r} is a {several[cid]} canary; the census takes single-request ones"
            )
        if cid not in known:
            raise InputError(f"--canary: unknown canary {cid!r} (not in the suites of the chosen backends)")
    censuses: list[Census] = []
    walls: list[float] = []
    stacks: dict[str, str] = {}
    unavailable: dict[str, str] = {}
    for name, canaries in work.items():
        chosen = [c for c in canaries if not canary_ids or c.id in canary_ids]
        if not chosen:
            continue
        # the census puts max(sizes) requests in flight at once, beyond the backend's usual concurrency
        progress.begin(len(chosen) * requests * len(sizes), name)
        bcfg = config.backend(name)
        b = make_backend(bcfg.model_copy(update={"concurrency": max(bcfg.concurrency, *sizes)}))
        try:
            stacks[name] = stack_hash(b.snapshot())
            for c in chosen:
                t0 = time.monotonic()
                censuses.append(
                    run_census(b, c, n=requests, batch_sizes=sizes, fillers=fillers_for(c, canaries))
                )
                walls.append(time.monotonic() - t0)
        except BackendUnavailable as e:
            unavailable[name] = str(e)
        finally:
            b.close()
    return CensusReport(requests, tuple(sizes), tuple(censuses), tuple(walls), stacks, unavailable, strict)
