"""Answers that flip: false drift and regression verdicts under honest flipping, and the passes to catch a
change of the answers, through the scripted kind with the default config (docs/detection.md, "Answers
that flip learn too").

    python bench/answers.py [--seeds 4] [--before 30] [--after 50]

Each scenario runs ``--seeds`` backends of three canaries: ``--before`` honest passes (learning included),
then a change, then up to ``--after`` passes. It prints the drift verdicts before the change per
canary-pass (with a 95 % upper bound) and, per changed canary, the pass after the change that first gave a
drift verdict.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
from pathlib import Path

import structlog

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.harness.scripted_lab import ScriptedLab, change, scripted, verdicts

DRIFT = {"regression", "reference-mismatch", "answer-drift", "logprob-drift", "stack-change"}
API = {"noise_model": {"preset": "api"}, "logprobs": False}
SCENARIOS = {
    "api, no logprobs: honest": (API, None),
    "api, no logprobs: a new text (capital)": (API, {"canaries": ["capital"], "text": "Paris!"}),
    "api, no logprobs: flips 24 % -> 70 % (capital)": (
        API,
        {"canaries": ["capital"], "noise_model": {"preset": "api", "text_flips": 0.7}},
    ),
    "gpu-bf16, ties 0.6: honest": ({"noise_model": {"preset": "gpu-bf16", "ties": 0.6}}, None),
    "wrong 20 %, noise 0.01: honest": ({"wrong_rate": 0.2, "noise": 0.01}, None),
    "wrong 20 % -> 100 %, noise 0.01": ({"wrong_rate": 0.2, "noise": 0.01}, {"wrong_rate": 1.0}),
    "wrong 20 % -> 60 %, no logprobs": ({"wrong_rate": 0.2, "logprobs": False}, {"wrong_rate": 0.6}),
}


def run(settings: dict, moved: dict | None, seed: int, before: int, after: int) -> tuple[int, int, dict]:
    """(drift verdicts before the change, canary-passes before it, changed canary → first drift pass)."""
    body = change(at=before + 1, **moved) if moved else ""
    with tempfile.TemporaryDirectory() as d:
        lab = ScriptedLab(Path(d), scripted(seed=seed, **settings, body=body))
        try:
            false = n = 0
            for _ in range(before):
                v = verdicts(lab.cycle())
                false += sum(x in DRIFT for x in v.values())
                n += len(v)
            first: dict[str, int] = {}
            changed = (moved or {}).get("canaries") or ["add", "capital", "colors"]
            for i in range(1, (after if moved else 0) + 1):
                for cid, x in verdicts(lab.cycle()).items():
                    if cid in changed and x in DRIFT:
                        first.setdefault(cid, i)
                if len(first) == len(changed):
                    break
            return false, n, first
        finally:
            lab.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--before", type=int, default=30)
    ap.add_argument("--after", type=int, default=50)
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    for name, (settings, moved) in SCENARIOS.items():
        false = total = 0
        caught: list[int] = []
        missed = 0
        for seed in range(args.seeds):
            f, n, first = run(settings, moved, seed, args.before, args.after)
            false, total = false + f, total + n
            if moved:
                want = len(moved.get("canaries") or [1, 2, 3])
                caught += first.values()
                missed += want - len(first)
        upper = 1 - 0.05 ** (1 / total) if false == 0 else float("nan")  # exact 95 % bound at 0 events
        line = f"{name}: {false} drift verdicts in {total} honest canary-passes"
        line += f" (95 % upper bound {upper:.2%})" if false == 0 else ""
        if moved:
            span = f"{min(caught)}..{max(caught)}, median {statistics.median(caught):g}" if caught else "-"
            line += f"; caught after {span} passes, missed {missed} within {args.after}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
