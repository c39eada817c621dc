"""canaryd's product path in the detection bench: what a user runs, not the judge on the bench's own probes.

The other canaryd rows call `compare` and `decide` on probes the bench collected, so a false alarm that only
the product raises (a `stack-change` from the pass's stack snapshot, a `new-configuration` behind a balancer,
learning state) never shows there. Here a real config names one backend; a deployment is the passes of
`canaryd check` (`canaryd.api.Canaryd.check`, what the command calls) on the baseline server until no
canary is learning (learning by default, no manual step); a test is one more `check` pass from a copy of
that deployed state with the backend pointed at the tested server, under the same backend name, as a
provider's silent change reaches a user. An alarm is the pass's exit code 1; exit 2 or 3 stops the bench
(a pass that could not judge is neither an alarm nor a quiet pass). The drift verdicts of each alarm are
kept, so a false one says what raised it.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.detection_lab import HONEST  # noqa: E402
from bench.intervals import clopper_pearson  # noqa: E402
from canaryd.api import Canaryd  # noqa: E402
from canaryd.config import load_config  # noqa: E402
from canaryd.errors import EXIT_DRIFT, EXIT_OK  # noqa: E402

SUITES = ("default.toml", "tracking.toml")  # the shipped suites, as shipped: one product row each
LEARN_PASSES = 32  # a deployment gives up when a canary still learns after this many passes


def vllm_block(base_url: str, name: str = "bench") -> str:
    """The ``[[backends]]`` block a user writes for a vLLM server."""
    return (
        f'[[backends]]\nname = "{name}"\nkind = "vllm"\nbase_url = {json.dumps(base_url)}\n'
        'model = "tiny"\ntimeout_s = 120\n'
    )


def write_config(root: Path, backend: str, suites: Sequence[Path]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / "canaryd.toml"
    files = json.dumps([str(s) for s in suites])
    path.write_text(f'state_dir = "state"\nsuites = {files}\n{backend}\n')
    return path


@dataclass
class Pass:
    exit_code: int
    drift: tuple[str, ...]  # the drift verdicts (and the pass's other failures) that made it exit 1


def one_pass(path: Path) -> Pass:
    passed = Canaryd(load_config(path)).check().passed
    if passed.exit_code not in (EXIT_OK, EXIT_DRIFT):
        first = passed.first_error
        why = f"{first.backend}: {first.error}" if first is not None else "; ".join(passed.config_errors)
        raise SystemExit(f"detection bench, product path: `check` exited {passed.exit_code} ({why})")
    drift = [r.comparison.verdict.value for r in passed.results if r.comparison.verdict.is_drift]
    return Pass(passed.exit_code, tuple(sorted(set(drift + list(passed.too_many)))))


@dataclass
class Deployment:
    """A folder holding a config and the state of a canaryd that has learned its backend."""

    root: Path
    suites: tuple[Path, ...]
    passes: list[Pass] = field(default_factory=list)  # the deployment's own passes

    @property
    def learned(self) -> bool:
        return bool(self.passes) and self.passes[-1].exit_code == EXIT_OK


def deploy(root: Path, backend: str, suites: Sequence[Path], max_passes: int = LEARN_PASSES) -> Deployment:
    """`canaryd check` on ``backend`` until a pass leaves no canary taking its baseline or still
    learning its noise model, or ``max_passes``."""
    path = write_config(root, backend, suites)
    dep = Deployment(root, tuple(suites))
    for _ in range(max_passes):
        checker = Canaryd(load_config(path))
        check = checker.check()
        dep.passes.append(Pass(check.exit_code, ()))
        if check.exit_code not in (EXIT_OK, EXIT_DRIFT):
            why = f"deploying on {root.name}: `check` exited {check.exit_code}"
            raise SystemExit(f"detection bench, product path: {why}")
        if "baseline" not in check.verdicts.values() and not any(r.learning for r in check.passed.runs):
            break
    return dep


def deploy_suites(root: Path, backend: str) -> dict[str, Deployment]:
    """A canaryd per shipped suite (`SUITES`), each deployed on ``backend`` in its own folder."""
    return {suite: deploy(root / suite, backend, [REPO / "canaries" / suite]) for suite in SUITES}


def passes_of(deps: dict[str, Deployment]) -> str:
    """How each suite's deployment went: its passes' exit codes."""
    return "; ".join(f"{suite} {[p.exit_code for p in d.passes]}" for suite, d in deps.items())


def trial_passes(dep: Deployment, backend: str, trials: int, work: Path) -> list[Pass]:
    """``trials`` tests: each one `check` pass from a fresh copy of the deployed state, on ``backend``."""
    out = []
    work.mkdir(parents=True, exist_ok=True)
    for _ in range(trials):
        # a path never used before: canaryd keeps what it read of a database by its address, so a copy
        # replacing another at the same path would look like a database pruned under it
        root = Path(tempfile.mkdtemp(prefix="trial-", dir=work))
        shutil.copytree(dep.root / "state", root / "state")
        out.append(one_pass(write_config(root, backend, dep.suites)))
        shutil.rmtree(root)
    return out


def alarms(passes: Sequence[Pass]) -> tuple[int, Counter]:
    """The alarms among ``passes`` and what raised them (a verdict counted once per pass)."""
    hits = [p for p in passes if p.exit_code == EXIT_DRIFT]
    return len(hits), Counter(v for p in hits for v in p.drift)


def table(results: dict[str, dict[str, list[Pass]]], honest: Sequence[str]) -> str:
    """Per variant (rows) and suite (columns): alarms/tests with the 95% Clopper–Pearson interval of the
    per-test rate (on the ``honest`` variants every alarm is false) and the verdicts that raised them."""
    suites = sorted({s for by in results.values() for s in by})
    lines = ["| variant | " + " | ".join(f"canaryd check, {s}" for s in suites) + " |"]
    lines.append("|---" * (len(suites) + 1) + "|")
    for variant, by in results.items():
        cells = []
        for s in suites:
            hits, why = alarms(by.get(s, []))
            low, high = clopper_pearson(hits, len(by.get(s, [])))
            what = "false alarms" if variant in honest else "power"
            raised = ", ".join(f"{v} {n}" for v, n in why.most_common()) or "none"
            cells.append(f"{what} {hits}/{len(by.get(s, []))} [{low:.3f}, {high:.3f}]; raised by: {raised}")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# SYNTHETIC: the scripted kind under the realistic noise model (`canaryd.backends.noise`), whose draws are
# fresh in every backend a `check` builds. The fleet's members report their own dtype in the snapshot, as
# two real servers behind a balancer do, and one answers 0.03 nats lower (another dtype's numerics).
NOISY_FLEET = [
    {"name": "fp32", "fingerprint": "fp-fp32", "snapshot": {"engine.dtype": "float32"}},
    {
        "name": "bf16",
        "fingerprint": "fp-bf16",
        "snapshot": {"engine.dtype": "bfloat16"},
        "logprob_shift": -0.03,
    },
]
NOISY_SHIFTS = (-0.001, -0.003, -0.01, -0.05, -0.3)  # nats on every logprob: within the noise, then beyond


def noisy(args) -> None:
    """The product path under the realistic noise model (SYNTHETIC, the scripted kind): each shipped suite
    deployed on one noisy backend and on a noisy two-member fleet; honest tests on each (false alarms), and
    logprob shifts on the single backend (power)."""
    from tests.harness.scripted_lab import change, scripted

    noise = {"noise_model": {"preset": args.noise}}
    blocks = {"N0": scripted(name="bench", **noise), "F": scripted(name="bench", fleet=NOISY_FLEET, **noise)}
    work = Path(tempfile.mkdtemp(prefix="canaryd-product-noisy-"))
    results: dict[str, dict[str, list[Pass]]] = {}
    t = time.perf_counter()
    for honest, block in blocks.items():
        deps = deploy_suites(work / honest, block)
        print(f"deployed on {honest} ({args.noise}): {passes_of(deps)}", flush=True)
        tests = {honest: (block, args.trials)}
        if honest == "N0":
            for shift in NOISY_SHIFTS:
                moved = scripted(name="bench", body=change(at=1, logprob_shift=shift), **noise)
                tests[f"shift {shift:+g}"] = (moved, args.power_trials)
        for variant, (tested, n) in tests.items():
            for suite, dep in deps.items():
                results.setdefault(variant, {})[suite] = trial_passes(dep, tested, n, work / "trials")
            print(f"{variant}: alarms {[alarms(p)[0] for p in results[variant].values()]}", flush=True)
    print(
        f"\nPRODUCT PATH, SYNTHETIC noise ({args.noise}, the scripted kind): {args.trials} honest `check` "
        f"passes per deployment and suite, {args.power_trials} per shift; {time.perf_counter() - t:.0f} s"
    )
    print(table(results, honest=tuple(blocks)))


def main() -> None:
    """The product path alone, on fewer servers than `detection.py` serves: the baseline server (the
    deployments), honest restarts, the fleet behind a random balancer (its own deployments), and D1, Q1 and
    the sub-argmax G3e-4 for power; with ``--noise PRESET``, the scripted kind under that preset of the
    realistic noise model instead (`noisy`)."""
    import argparse

    from canaryd import log

    ap = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=10, help="`check` passes per server and suite")
    ap.add_argument("--restarts", type=int, default=2, help="honest restarts (N0 servers)")
    ap.add_argument("--noise", metavar="PRESET", help="the scripted kind under this realistic noise preset")
    ap.add_argument("--power-trials", type=int, default=20, help="with --noise: `check` passes per shift")
    args = ap.parse_args()
    log.configure("warning")
    if args.noise:
        return noisy(args)

    from bench.detection_lab import CACHE, bench_canaries, server, trained_model
    from canaryd.lab.tinymodel import perturb_weights
    from tests.harness.balancer import Balancer

    logs = Path(tempfile.mkdtemp(prefix="canaryd-product-"))
    model = trained_model(bench_canaries())
    G = {"mode": "noise", "scale": 3e-4}
    plan = [("N0", model, "float32")] * args.restarts + [
        ("D1", model, "bfloat16"),
        ("Q1", perturb_weights(model, CACHE / "detection-trained-seed0-int8", mode="int8"), "float32"),
        ("G3e-4", perturb_weights(model, CACHE / "detection-trained-seed0-noise0.0003", **G), "float32"),
    ]
    results: dict[str, dict[str, list[Pass]]] = {}

    def run(variant: str, deps: dict[str, Deployment], base_url: str) -> None:
        block = vllm_block(base_url)
        for suite, dep in deps.items():
            got = trial_passes(dep, block, args.trials, logs / "work")
            results.setdefault(variant, {}).setdefault(suite, []).extend(got)
        hits = {s: f"{alarms(p)[0]}/{len(p)}" for s, p in results[variant].items()}
        print(f"{variant}: alarms so far {hits}", flush=True)

    t = time.perf_counter()
    with server(model, "float32", logs, "baseline") as base:
        deps = deploy_suites(logs / "baseline", vllm_block(base.base_url))
        print(f"deployed on the baseline server: {passes_of(deps)}", flush=True)
        for i, (variant, w, dtype) in enumerate(plan):
            with server(w, dtype, logs, f"{variant}-{i}") as srv:
                run(variant, deps, srv.base_url)
    with (
        server(model, "float32", logs, "F-f32") as f32,
        server(model, "bfloat16", logs, "F-bf16") as bf16,
        Balancer({f32.port: 1, bf16.port: 1}) as lb,
    ):
        fleet = deploy_suites(logs / "F", vllm_block(lb.base_url))
        print(f"deployed on the fleet: {passes_of(fleet)}", flush=True)
        run("F", fleet, lb.base_url)
    print(
        f"\nPRODUCT PATH, reduced run: {args.trials} `check` passes per server and suite, "
        f"N0 over {args.restarts} restarts; {time.perf_counter() - t:.0f} s"
    )
    print(table(results, honest=HONEST))


if __name__ == "__main__":
    main()
