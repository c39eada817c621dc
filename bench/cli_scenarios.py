"""The CLI scenarios a restructuring must leave unchanged, printed so two checkouts can be diffed.

Every command a user runs against the history goes through the real CLI in a subprocess, on backends of
the ``scripted`` kind (a plain one that shifts its logprobs and its dtype from the third pass, a two-member
fleet and a backend that is down), each step printed as its command line, exit code, stdout and stderr.
What differs between two honest runs (times, durations, run ids, the temporary folder) is masked, so
the output of one checkout is byte-identical to another's exactly when the user would see no difference::

    python bench/cli_scenarios.py > before.txt        # on the old checkout
    python bench/cli_scenarios.py > after.txt         # on the new one
    diff before.txt after.txt

Run from the repository root of the checkout under test (its ``canaryd`` is the one imported).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SUITE = """
[suite]
name = "plain"
[defaults]
max_tokens = 16
[[canary]]
id = "add"
messages = [{ role = "user", content = "What is 17 + 25? Answer with the number only." }]
expect = { number = 42, answer = "42" }
[[canary]]
id = "capital"
messages = [{ role = "user", content = "What is the capital of France? Answer with one word." }]
expect = { regex = "^paris\\\\.?$", answer = "Paris" }
[[canary]]
id = "colors"
prompt = "The three primary colors of light are red, green and"
decoding = { max_tokens = 5 }
expect = { regex = "^ ?blue", answer = " blue" }
"""

CONFIG = """state_dir = "state"
suites = ["plain.toml"]

[[backends]]
name = "steady"
kind = "scripted"
latency_s = 0
retry_backoff = 0
cycle_file = "steady.cycle"
[[backends.changes]]
at = 3
logprob_shift = -0.2
stack = {{ "engine.dtype" = "bfloat16" }}

[[backends]]
name = "fleet"
kind = "scripted"
latency_s = 0
retry_backoff = 0
seed = 7
fleet_pick = "round-robin"
cycle_file = "fleet.cycle"
[[backends.fleet]]
name = "fp32"
fingerprint = "vllm-fp32"
[[backends.fleet]]
name = "bf16"
fingerprint = "vllm-bf16"
logprob_shift = -0.03

[[backends]]
name = "down"
kind = "openai"
base_url = "http://127.0.0.1:{port}/v1"
model = "nobody"
timeout_s = 2
retries = 0
"""

# Arguments of each step; `{dir}` is the scenario's folder, `{run0}`, `{run1}` … the run ids seen so far
# (in the order the outputs first named them). The backends of one pass are probed in parallel, so their
# run and observation ids interleave by chance: steps up to the last few name one backend each, and the
# steps marked `IDS` (the passes over every backend, at the end) have their ids masked.
IDS = "ids"
STEPS: list[tuple[str, ...]] = [
    ("--version",),
    ("validate",),
    ("validate", "--json"),
    ("check", "--backend", "steady"),
    ("check", "--backend", "fleet", "--json"),
    ("check", "--backend", "down"),
    ("probe", "--backend", "fleet"),
    ("history", "--limit", "8"),
    ("stack",),
    ("pin", "--backend", "steady", "--out", "{dir}/pin.json"),
    ("check", "--pin", "{dir}/pin.json", "--backend", "steady"),
    ("check", "--backend", "steady", "--json"),
    ("check", "--backend", "fleet", "--max-configurations", "1"),
    ("explain", "steady"),
    ("explain", "steady", "add", "--json"),
    ("stack", "--json"),
    ("history", "--backend", "steady", "--canary", "add", "--json"),
    ("diff", "{run0}", "{run4}"),
    ("diff", "{run0}", "{run4}", "--json"),
    ("record", "--run", "{run0}", "--run", "{run4}", "--pin", "{dir}/pin.json"),
    ("record", "--since", "1h", "--format", "json"),
    ("export", "--run", "{run0}"),
    ("census", "--backend", "steady", "-n", "3", "--batch-sizes", "1,2"),
    ("baseline", "calibrate", "--backend", "fleet", "-k", "4", "--batch-sizes", "1,2"),
    ("baseline", "accept", "--backend", "steady"),
    ("check", "--backend", "steady"),
    ("prune", "--older-than", "3650d"),
    ("db", "current"),
    ("nosuchcommand",),
    ("check", "--backend", "nosuch"),
    ("history", "--limit", "0"),
    (IDS, "check"),
    (IDS, "check", "--json"),
    (IDS, "pin"),
]

_RUN_ID = re.compile(r'"run_id": "?([0-9A-Za-z_-]+)')
_MASKS = [
    (re.compile(r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(\.\d+)?(\+00:00|Z)?"), "<time>"),
    (re.compile(r"\b\d\d:\d\d:\d\d\b"), "<hh:mm:ss>"),
    (re.compile(r"\d+(\.\d+)? ?(ms|s)\b"), "<dur>"),
    (re.compile(r'"(duration|latency|elapsed)[a-z_]*": [0-9.e-]+'), r'"\1": <n>'),
    (re.compile(r"\b[0-9a-f]{32}\b"), "<id32>"),
    (re.compile(r"\b(\d+) (seconds|minutes|hours|days) ago\b"), "<ago>"),
    (re.compile(r"pid[ =:]\d+"), "pid=<n>"),
]


_IDS = re.compile(r'(\b(?:run|observation)[ _]|"(?:run_id|observation_id|id)": )\d+')


def _mask(text: str, root: str, ids: bool) -> str:
    text = text.replace(root, "<dir>")
    if ids:
        text = _IDS.sub(r"\1<id>", text)
    for pattern, repl in _MASKS:
        text = pattern.sub(repl, text)
    return text


def main() -> int:
    import socket

    with socket.socket() as s:  # a port nothing listens on: the "down" backend
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="canaryd-scenarios-") as tmp:
        root = Path(tmp)
        (root / "plain.toml").write_text(SUITE)
        (root / "canaryd.toml").write_text(CONFIG.format(port=port))
        env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "160", "PYTHONPATH": str(REPO), "TZ": "UTC"}
        runs: list[str] = []
        for step in STEPS:
            masked = step[0] == IDS
            step = step[1:] if masked else step
            args = [a.format(dir=tmp, **{f"run{i}": r for i, r in enumerate(runs)}) for a in step]
            p = subprocess.run(
                [sys.executable, "-m", "canaryd", "-c", str(root / "canaryd.toml"), *args],
                capture_output=True,
                text=True,
                cwd=tmp,
                env=env,
                timeout=300,
            )
            for found in _RUN_ID.findall(p.stdout):
                if found not in runs:
                    runs.append(found)
            print(f"$ canaryd {' '.join(step)}\n[exit {p.returncode}]")
            print(_mask(p.stdout, tmp, masked).rstrip())
            if p.stderr.strip():
                print("--- stderr")
                print(_mask(p.stderr, tmp, masked).rstrip())
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
