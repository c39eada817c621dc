"""The HTML report's size and render time for three runs, side by side: the demo's shape (the shipped
canaries, a silent dtype shift at run 3) and the seed study's (200 three-step questions, steps and answers
moving between runs). Runs on the scripted kind, no server.

    .venv/bin/python bench/html_report.py [--png docs/report.png]

``--png`` also screenshots the demo-shaped report with headless Chromium (the picture in docs/record.md).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from canaryd.report.html import write_report  # noqa: E402
from tests.harness.scripted_lab import ScriptedLab, change, scripted  # noqa: E402

# The scripted kind answers a chain's steps by a substring of each step's prompt.
STEPS = {
    "List the policy terms": "covers fire, lightning, windstorm; excludes flood, surface water, waves",
    "Map the facts onto": "storm surge = flood and waves: excluded; the wind did not cause the loss",
    "Is the storm-surge damage covered": "No",
    "List what the statement says": "yearly, independent, unannounced audits of direct suppliers",
    "Map the statement onto": "audits: yes; independent: yes; unannounced: yes",
    "Does the statement disclose": "Yes",
}


def demo_shaped(root: Path) -> tuple[ScriptedLab, list[int]]:
    """Two float32 passes, then bfloat16: every logprob shifts, one answer and a chain's reasoning move."""
    body = (
        change(at=3, stack={"engine.dtype": "bfloat16"}, logprob_shift=-0.004, fingerprint="fp_bf16")
        + change(at=3, canaries=["arith-mul"], text="134")
        # a chain's steps share its id: its reasoning moves, its two-token final answer stays "No"
        + change(at=3, canaries=["chain-insurance-flood"], text="No: flood is excluded, whatever the wind")
    )
    suites = {n: (REPO / "canaries" / n).read_text() for n in ("default.toml", "chained.toml")}
    backend = scripted(
        "local-vllm",
        body=body,
        answers=STEPS,
        stack={"engine.dtype": "float32", "vllm.version": "0.32.0"},
        fingerprint="fp_fp32",
    )
    lab = ScriptedLab(root, backend, suites)
    return lab, [lab.cycle("local-vllm").run_id for _ in range(3)]


def seed_shaped(root: Path, questions: int = 200) -> tuple[ScriptedLab, list[int]]:
    """The seed study's size: 200 questions of three steps; at run 2, 23 questions reason differently to
    the same answer and 2 change their answer (52 steps)."""
    suite = ['[suite]\nname = "supply"\n[defaults]\nmax_tokens = 96\n']
    for q in range(questions):
        suite.append(f'[[canary]]\nid = "q{q:03d}"\nexpect = {{ choices = ["yes"], answer = "yes" }}\n')
        for step in ("extract", "map", "answer"):
            suite.append(f'[[canary.steps]]\nid = "{step}"\nprompt = "question {q} step {step}"\n')
    answers = {
        f"step {s}": f"{s}: the terms the question turns on, and the facts" for s in ("extract", "map")
    }
    body = change(at=2, canaries=[f"q{q:03d}" for q in range(2, 25)], text="yes") + change(
        at=2, canaries=["q000", "q001"], text="no"
    )
    lab = ScriptedLab(
        root, scripted(body=body, answers={**answers, "step answer": "yes"}), {"supply.toml": "".join(suite)}
    )
    return lab, [lab.cycle().run_id for _ in range(3)]


def measure(name: str, build, root: Path) -> Path:
    lab, runs = build(root)
    try:
        t = time.perf_counter()
        size = write_report(lab.store, runs, root / "report.html")
        took = time.perf_counter() - t
        steps = sum(1 for _ in lab.store.load(lab.store.ids_of_runs(runs)))
    finally:
        lab.close()
    print(f"{name:<14} {len(runs)} runs {steps:>5} observations  {size / 1024:>7.1f} KiB  {took:>5.2f} s")
    return root / "report.html"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--png", type=Path, help="write a screenshot of the demo-shaped report here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "demo").mkdir()
        (Path(tmp) / "seed").mkdir()
        demo = measure("demo-shaped", demo_shaped, Path(tmp) / "demo")
        measure("seed-shaped", seed_shaped, Path(tmp) / "seed")
        if args.png:
            argv = [
                shutil.which("chromium") or "chromium",
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-extensions",
                f"--user-data-dir={tmp}/profile",
                "--hide-scrollbars",
                "--window-size=1280,2400",
                f"--screenshot={args.png.resolve()}",
                demo.as_uri(),
            ]
            subprocess.run(argv, check=True, capture_output=True, timeout=120)
            print(f"{args.png}: {args.png.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
