"""The detection bench's serving (`serve_all`): every vLLM server of a run, one (or, for the fleet, two) at
a time beside the baseline server, and what each gave. `bench/detection.py` analyses it, or a pickle of
it (``--probes``) without serving again."""

from __future__ import annotations

import itertools
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bench.detection_lab import (
    Served,
    backend_for,
    collect,
    forced_canaries,
    greedy_probes,
    lt_probes,
    reference_checks,
    sampled,
    server,
    tracking_canaries,
)
from bench.detection_met import completions
from bench.detection_methods import Reference
from bench.detection_product import deploy_suites, passes_of, trial_passes, vllm_block
from canaryd.judge.stats import fit
from tests.harness.balancer import Balancer

if TYPE_CHECKING:
    from bench.detection import Settings


def serve_all(
    canaries: list, model: Path, weights: dict[str, Path], settings: Settings, logs: Path, seed: int
) -> tuple[Reference, dict[str, list[Served]], list[int], dict[str, float]]:
    """Every server of the run, one (or, for the fleet, two) at a time beside the baseline server, which
    stays up as every variant's reference: what each gave."""
    phases: dict[str, float] = {}
    rng = random.Random(seed)
    servers: dict[str, list[Served]] = {}
    # 1. the baseline server: calibration and baseline texts, the forced canaries, the peers' references
    t = time.perf_counter()
    with server(model, "float32", logs, "baseline") as srv:
        reference = backend_for(srv.base_url)
        try:
            calibration = greedy_probes(reference, canaries, settings.k)
            forced = forced_canaries(reference)
            tracking = tracking_canaries()
            ref = Reference(
                canaries,
                calibration,
                {cid: fit(obs) for cid, obs in calibration.items()},
                {cid: obs[0] for cid, obs in calibration.items()},
                sampled(reference, canaries, settings.samples, rng),
                lt_probes(reference, settings.lt_pool),
                settings.k,
                forced,
                greedy_probes(reference, forced, settings.k),
                tracking=tracking,
                tracking_calibration=greedy_probes(reference, tracking, settings.k),
            )
            ref.met = completions(srv.base_url, settings.met_pool, rng)  # MET's reference completions
            # the product path: a canaryd per shipped suite deployed on the baseline server, as a user runs it
            products = deploy_suites(logs / "product" / "baseline", vllm_block(srv.base_url))
            print(f"product path, deployed on the baseline server: {passes_of(products)}", flush=True)
            phases["baseline server"] = time.perf_counter() - t
            print(
                f"baseline: {len(canaries)} canaries, K={settings.k} probes each, regimes: "
                + ", ".join(f"{cid} {m.regime.value}" for cid, m in ref.models.items())
                + f"; forced: {', '.join(f'{c.prompt!r} → {c.continuation!r}' for c in forced)}",
                flush=True,
            )

            def take(variant: str, base_url: str, startup: float, deployed_here: bool = False) -> None:
                """Probe a server; ``deployed_here``: canaryd also calibrates on it (the fleet)."""
                backend = backend_for(base_url)
                stamps = [("", time.perf_counter())]  # where a server's time goes, printed

                def lap(step: str) -> None:
                    stamps.append((step, time.perf_counter()))

                try:
                    s = collect(variant, backend, startup, canaries, forced, tracking, settings, rng)
                    lap("probes and samples")
                    if deployed_here:
                        s.extra["calibration"] = greedy_probes(backend, canaries, settings.k)
                        s.extra["forced calibration"] = greedy_probes(backend, forced, settings.k)
                        s.extra["tracking calibration"] = greedy_probes(backend, tracking, settings.k)
                        lap("calibration")
                    block = vllm_block(base_url)
                    deps = products
                    if deployed_here:  # a user deploys on the fleet through its balancer
                        deps = deploy_suites(logs / "product" / variant, block)
                        print(f"product path, deployed on {variant}: {passes_of(deps)}", flush=True)
                        lap("product deployment")
                    s.product = {
                        suite: trial_passes(dep, block, settings.product_trials, logs / "product" / "work")
                        for suite, dep in deps.items()
                    }
                    lap("product passes")
                    s.met = completions(base_url, settings.met_pool, rng)
                    lap("MET completions")
                    checks, scored = reference_checks(reference, canaries, s.greedy)
                    ref.checks.update(checks)
                    ref.scored.update(scored)
                    lap("reference checks")
                    servers.setdefault(variant, []).append(s)
                finally:
                    backend.close()
                laps = ", ".join(f"{b[0]} {b[1] - a[1]:.0f} s" for a, b in itertools.pairwise(stamps))
                print(f"  {variant}: {laps}", flush=True)

            # 2. an honest restart and the bf16 server together, and the fleet (both behind a balancer)
            t = time.perf_counter()
            with (
                server(model, "float32", logs, "N0-0") as f32,
                server(model, "bfloat16", logs, "D1") as bf16,
            ):
                take("N0", f32.base_url, f32.startup_seconds or 0.0)
                take("D1", bf16.base_url, bf16.startup_seconds or 0.0)
                with Balancer({f32.port: 1, bf16.port: 1}, seed=seed) as lb:
                    take("F", lb.base_url, 0.0, deployed_here=True)
                    fleet_hits = [lb.served.get(port, 0) for port in (f32.port, bf16.port)]
            phases["N0, D1 and F servers"] = time.perf_counter() - t
            print(
                f"N0, D1, F: served and probed in {phases['N0, D1 and F servers']:.0f} s "
                f"(F split {fleet_hits})",
                flush=True,
            )

            # 3. the other variants, one server at a time
            plan = [("N0", model, "float32")] * (settings.restarts - 1) + [
                (v, w, "float32") for v, w in weights.items()
            ]
            for i, (variant, w, dtype) in enumerate(plan, 1):
                t = time.perf_counter()
                with server(w, dtype, logs, f"{variant}-{i}") as srv:
                    take(variant, srv.base_url, srv.startup_seconds or 0.0)
                phases[f"{variant} server {i}"] = time.perf_counter() - t
                print(f"{variant}: served and probed in {phases[f'{variant} server {i}']:.0f} s", flush=True)
        finally:
            reference.close()
    return ref, servers, fleet_hits, phases
