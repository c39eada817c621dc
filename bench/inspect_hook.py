"""What canaryd's Inspect AI hook costs: a real `inspect eval` of the 20-sample test task against a loopback
OpenAI-compatible server, side by side in one run, alternating:

* **absent**: Inspect with canaryd's entry point filtered out (as if canaryd were not installed);
* **off**: the hook installed, ``CANARYD_CONFIG`` unset (the default): it must cost nothing measurable;
* **on**: ``CANARYD_CONFIG`` set: two canary passes per task, no request per sample.

Prints each mode's median wall time, the ratio off / absent, and the requests the server saw per run
(on − off: what the hook adds).

    python bench/inspect_hook.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.harness.loopback import Loopback  # noqa: E402

TASK = REPO / "tests" / "harness" / "inspect_arith.py"
ABSENT = """
import importlib.metadata as md, sys
_real = md.entry_points
def entry_points(**kw):
    eps = _real(**kw)
    if kw.get("group") == "inspect_ai":
        return md.EntryPoints(e for e in eps if not e.value.startswith("canaryd"))
    return eps
md.entry_points = entry_points
from inspect_ai._cli.main import main
sys.argv = ["inspect", *sys.argv[1:]]
main()
"""
CONFIG = """
state_dir = "state"
suites = ["suite.toml"]
[[backends]]
name = "lb"
kind = "openai"
base_url = "{base}"
model = "m"
"""
SUITE = """
[suite]
name = "gate"
[[canary]]
id = "add"
messages = [{ role = "user", content = "What is 17 + 25?" }]
[[canary]]
id = "capital"
messages = [{ role = "user", content = "Capital of France?" }]
"""


def run(mode: str, root: Path, base: str) -> float:
    args = ["eval", TASK.name, "--model", "openai-api/lb/m", "--log-dir", str(root / "logs" / mode)]
    args += ["--display", "none", "--max-connections", "4"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CANARYD_")}
    env |= {"LB_BASE_URL": base, "LB_API_KEY": "none"}
    if mode == "on":
        env["CANARYD_CONFIG"] = str(root / "canaryd.toml")
    inspect = str(Path(sys.executable).with_name("inspect"))
    argv = [sys.executable, "-c", ABSENT, *args] if mode == "absent" else [inspect, *args]
    t0 = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=root, timeout=600)
    if p.returncode:
        raise SystemExit(f"inspect eval ({mode}) failed: {p.stderr[-2000:]}")
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    times: dict[str, list[float]] = {"absent": [], "off": [], "on": []}
    requests: dict[str, list[int]] = {m: [] for m in times}
    with tempfile.TemporaryDirectory(prefix="inspect-hook-") as tmp, Loopback() as lb:
        root, base = Path(tmp), lb.base("ok")
        (root / "suite.toml").write_text(SUITE)
        (root / TASK.name).write_text(TASK.read_text())  # Inspect takes a task file relative to its cwd
        (root / "canaryd.toml").write_text(CONFIG.format(base=base))
        for i in range(args.runs):
            for mode in times if i % 2 == 0 else reversed(times):
                before = len(lb.requests)
                times[mode].append(run(mode, root, base))
                requests[mode].append(len(lb.requests) - before)
    med = {m: statistics.median(v) for m, v in times.items()}
    print(
        f"# inspect eval, 20 samples, loopback server, {args.runs} runs a mode (alternating), median wall s"
    )
    print("| mode | median s | min–max s | requests a run |")
    print("|---|---|---|---|")
    for m, v in times.items():
        print(f"| {m} | {med[m]:.2f} | {min(v):.2f}–{max(v):.2f} | {statistics.median(requests[m]):g} |")
    added = statistics.median(requests["on"]) - statistics.median(requests["off"])
    ratio, extra = med["off"] / med["absent"], med["on"] - med["off"]
    print(f"\noff / absent = {ratio:.3f}; on − off = {extra:+.2f} s and {added:g} requests per task")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
