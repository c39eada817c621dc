"""How fast the CLI starts (issue #16), and how soon a long command shows that it is working.

CPU time (user + sys, from ``getrusage(RUSAGE_CHILDREN)`` around each run) of ``canaryd --help``,
``--version``, ``validate`` (the config ``canaryd init`` writes: every kind's settings validated) and
``history --help``, next to ``python -c pass`` measured in the same run: the median of ``--runs`` runs each.
Then ``validate`` of one suite of 200, 1,000 and 10,000 canaries on 2 backends, each as a multiple of ``python
-c pass`` (the target at 200: at most 10×) and in milliseconds per 1,000 canaries beyond the first 200 (linear
and cheap: the same figure at each size). With ``--against DIR`` every command also runs with another
checkout's code (e.g. the tree before the change), its runs interleaved with this tree's. Then ``census`` on
the scripted kind under a pseudo-terminal: seconds until the first progress line, and until the table.

    PYTHONPATH=. .venv/bin/python bench/cli_startup.py [--runs 7] [--against /path/to/other/checkout]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.harness.scripted_lab import PLAIN, scripted  # noqa: E402
from tests.harness.terminal import run_in_terminal  # noqa: E402


def cpu_s(argv: list[str], env: dict[str, str], cwd: Path) -> float | str:
    """User + sys CPU seconds of one run of ``argv``, or why it failed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        return f"exit {p.returncode}"
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def medians(argv: list[str], envs: list[dict[str, str]], cwd: Path, runs: int) -> list[str]:
    """The median per environment (tree) as table cells, runs interleaved so that a load that comes and goes
    weighs on every column alike (a failed run is shown instead: the other tree may lack a feature)."""
    times: list[list[float | str]] = [[] for _ in envs]
    for _ in range(runs):
        for ts, env in zip(times, envs, strict=True):
            ts.append(cpu_s(argv, env, cwd))
    cells = []
    for ts in times:
        failed = [t for t in ts if isinstance(t, str)]
        cells.append(failed[0] if failed else f"{statistics.median(ts):.3f}")  # type: ignore[type-var]
    return cells


def suite(n: int) -> str:
    """A suite of ``n`` chat canaries, each its own prompt and exact answer."""
    rows = ['[suite]\nname = "big"']
    for i in range(n):
        rows.append(
            f'[[canary]]\nid = "c{i}"\nmessages = [{{ role = "user", content = "What is {i} + 1?" }}]\n'
            f'expect = {{ exact = "{i + 1}" }}'
        )
    return "\n".join(rows) + "\n"


TWO_BACKENDS = "".join(
    f'[[backends]]\nname = "{n}"\nkind = "vllm"\nbase_url = "http://127.0.0.1:{p}/v1"\nmodel = "m"\n'
    for n, p in (("a", 8000), ("b", 8001))
)


def suite_sizes(work: Path, envs: dict[str, dict[str, str]], runs: int, canaryd: list[str]) -> None:
    """``validate`` at 200, 1,000 and 10,000 canaries beside ``python -c pass``, the trees interleaved."""
    sizes = (200, 1000, 10_000)
    argv = {}
    for n in sizes:
        (work / f"suite{n}.toml").write_text(suite(n))
        cfg = work / f"validate{n}.toml"
        cfg.write_text(f'state_dir = "state"\nsuites = ["suite{n}.toml"]\n{TWO_BACKENDS}')
        argv[n] = [*canaryd, "-c", str(cfg), "validate"]
    floor: list[float | str] = []
    cpu: dict[tuple[str, int], list[float | str]] = {(t, n): [] for t in envs for n in sizes}
    for _ in range(runs):  # interleaved: a load that comes and goes weighs on every column alike
        floor.append(cpu_s([sys.executable, "-c", "pass"], next(iter(envs.values())), work))
        for tree, env in envs.items():
            for n in sizes:
                cpu[tree, n].append(cpu_s(argv[n], env, work))
    failed = [t for t in (*floor, *(t for ts in cpu.values() for t in ts)) if isinstance(t, str)]
    if failed:
        raise SystemExit(f"validate failed: {failed[0]}")
    base = statistics.median(floor)  # type: ignore[type-var]
    print(f"\nvalidate, one suite on 2 backends, CPU seconds (median of {runs}); python -c pass {base:.3f}")
    print(f"{'tree':<22}{'canaries':>10}{'CPU s':>10}{'x pass':>10}{'ms / 1,000 beyond 200':>24}")
    for tree in envs:
        med = {n: statistics.median(cpu[tree, n]) for n in sizes}  # type: ignore[type-var]
        for n in sizes:
            per = "" if n == sizes[0] else f"{(med[n] - med[sizes[0]]) / (n - sizes[0]) * 1e6:.1f}"
            print(f"{tree[-22:]:<22}{n:>10,}{med[n]:>10.3f}{med[n] / base:>10.1f}{per:>24}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--against", type=Path, help="another checkout to measure beside this one")
    args = ap.parse_args()
    trees = {"this tree": ROOT} | ({f"{args.against}": args.against} if args.against else {})
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1"}
        env.pop("PYTHONDONTWRITEBYTECODE", None)  # as installed: modules load from their cached bytecode
        canaryd = [sys.executable, "-m", "canaryd"]
        (work / "init").mkdir()
        subprocess.run([*canaryd, "init", str(work / "init")], env=env, check=True, capture_output=True)
        commands = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "canaryd --help": [*canaryd, "--help"],
            "canaryd --version": [*canaryd, "--version"],
            "canaryd validate": [*canaryd, "-c", str(work / "init" / "canaryd.toml"), "validate"],
            "canaryd history --help": [*canaryd, "history", "--help"],
        }
        envs = {name: {**env, "PYTHONPATH": str(tree)} for name, tree in trees.items()}
        print(f"CPU seconds (user+sys), median of {args.runs} runs")
        print(f"{'command':<26}" + "".join(f"{name[-22:]:>22}" for name in trees))
        for label, argv in commands.items():
            print(
                f"{label:<26}"
                + "".join(f"{c:>22}" for c in medians(argv, list(envs.values()), work, args.runs))
            )

        suite_sizes(work, envs, args.runs, canaryd)

        (work / "plain.toml").write_text(PLAIN)
        cfg = work / "canaryd.toml"
        cfg.write_text(f'state_dir = "state"\nsuites = ["plain.toml"]\n{scripted(latency_s=0.01)}')
        census = [*canaryd, "census", "-c", str(cfg), "-n", "20", "--batch-sizes", "1,4"]
        firsts, counting, tables = [], [], []
        for _ in range(max(3, args.runs // 2)):
            screen = run_in_terminal(census, columns=120, env={**env, "TERM": "xterm"})
            firsts.append(screen.first("census: …"))
            counting.append(screen.first("census: 0/"))
            tables.append(screen.first("canaryd census"))
        if None in (*firsts, *counting, *tables):
            raise SystemExit(f"census showed no progress or no table:\n{screen.text}")
        print(
            "\ncensus at a terminal (scripted kind, 3 canaries x 20 probes x 2 batch sizes, 10 ms each), "
            f"wall seconds, median of {len(firsts)}:"
        )
        print(f"  first progress line  {statistics.median(firsts):.3f}")
        print(f"  first count          {statistics.median(counting):.3f}")
        print(f"  table                {statistics.median(tables):.3f}")


if __name__ == "__main__":
    main()
