"""How fast the CLI starts (issue #16), and how soon a long command shows that it is working.

CPU time (user + sys, from ``getrusage(RUSAGE_CHILDREN)`` around each run) of ``canaryd --help``,
``--version``, ``validate`` (the config ``canaryd init`` writes: every kind's settings validated) and
``history --help``, next to ``python -c pass`` measured in the same run: the median of ``--runs`` runs
each. With ``--against DIR`` the same commands also run with another checkout's code (e.g. the tree
before the change) in a column beside this one. Then ``census`` on the scripted kind under a
pseudo-terminal: seconds until the first progress line, and until the table.

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


def median_cpu(argv: list[str], env: dict[str, str], cwd: Path, runs: int) -> str:
    """The median as a table cell (a failed run is shown instead: the other tree may lack a feature)."""
    times = [cpu_s(argv, env, cwd) for _ in range(runs)]
    failed = [t for t in times if isinstance(t, str)]
    return failed[0] if failed else f"{statistics.median(times):.3f}"  # type: ignore[type-var]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--against", type=Path, help="another checkout to measure beside this one")
    args = ap.parse_args()
    trees = {"this tree": ROOT} | ({f"{args.against}": args.against} if args.against else {})
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1"}
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
        print(f"CPU seconds (user+sys), median of {args.runs} runs")
        print(f"{'command':<26}" + "".join(f"{name:>22}" for name in trees))
        for label, argv in commands.items():
            cells = []
            for tree in trees.values():
                tree_env = {**env, "PYTHONPATH": str(tree)}
                cells.append(f"{median_cpu(argv, tree_env, work, args.runs):>22}")
            print(f"{label:<26}" + "".join(cells))

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
