"""Chained canaries and `canaryd diff` against a real vLLM (CPU) server serving the tiny model.

Two unchanged runs of a three-step plan and a plain canary diff to nothing (exit 0). Then the server is
restarted on noise-perturbed weights: every step is measured against its own baseline (none re-baselines,
although each later step's rendered prompt changed), the check names the step that diverged first, and
`canaryd diff` between the first and the last run reports the changed steps and one stack per run, a
different one (exit 1). Two server starts in all.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from canaryd.vllm_process import VLLMServer, free_port
from tests.conftest import CACHE

pytestmark = pytest.mark.vllm

SUITE = """
[suite]
name = "plans"
[defaults]
max_tokens = 8
[[canary]]
id = "plan"
expect = { regex = "." }
[[canary.steps]]
id = "extract"
messages = [{ role = "user", content = "Policy: fire is covered, flood is not. List the terms." }]
[[canary.steps]]
id = "map"
messages = [{ role = "user", content = "Terms: {{ extract }}. Facts: the river flooded. Map them." }]
[[canary.steps]]
id = "answer"
messages = [{ role = "user", content = "Analysis: {{map}}. Covered? Answer yes or no." }]
decoding = { max_tokens = 4 }
[[canary]]
id = "plain"
messages = [{ role = "user", content = "What is 17 + 25? Answer with the number only." }]
"""

CONFIG = """
state_dir = "state"
suites = ["suite.toml"]
[[backends]]
name = "local"
kind = "vllm"
base_url = "http://127.0.0.1:{port}/v1"
model = "tiny"
timeout_s = 60
"""

STEPS = ["plan:extract", "plan:map", "plan:answer"]
DRIFT = {"regression", "answer-drift", "logprob-drift"}


class Lab:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        (root / "suite.toml").write_text(SUITE)
        (root / "canaryd.toml").write_text(CONFIG.format(port=self.port))
        self.runs: list[int] = []

    def serve(self, model: Path) -> VLLMServer:
        return VLLMServer(
            model, port=self.port, extra_args=["--enforce-eager"], log_path=self.root / f"{model.name}.log"
        )

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "canaryd", "-c", str(self.root / "canaryd.toml"), *args],
            capture_output=True,
            text=True,
            env=dict(os.environ),
            timeout=600,
        )

    def check(self) -> tuple[int, dict[str, dict]]:
        p = self.cli("check", "--json")
        assert "Traceback" not in p.stderr, p.stderr
        results = json.loads(p.stdout)["results"]
        self.runs.append(results[0]["run_id"])
        return p.returncode, {r["canary"]: r for r in results}

    def diff(self, a: int, b: int) -> tuple[int, dict]:
        p = self.cli("diff", str(a), str(b), "--json")
        assert "Traceback" not in p.stderr, p.stderr
        return p.returncode, json.loads(p.stdout)["pairs"][0]


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> Lab:
    return Lab(tmp_path_factory.mktemp("chain-e2e"))


@pytest.fixture(scope="module")
def noisy_model(tiny_model: Path) -> Path:
    from canaryd.tinymodel import perturb_weights

    # large enough that greedy tokens change, not just logprobs (checked: the diff must count changed steps)
    return perturb_weights(tiny_model, CACHE / "random-seed0-noise0.5", mode="noise", scale=0.5)


def test_two_unchanged_runs_of_a_plan_diff_to_nothing(lab, tiny_model):
    with lab.serve(tiny_model):
        code, first = lab.check()
        assert code == 0 and list(first) == [*STEPS, "plain"]
        assert {r["verdict"] for r in first.values()} == {"baseline"}
        assert all(first[s]["text"] for s in STEPS)
        code, again = lab.check()
    assert code == 0 and {r["verdict"] for r in again.values()} == {"identical"}
    assert again["plan:answer"]["first_diverged_step"] is None

    code, pair = lab.diff(*lab.runs)
    assert code == 0 and not pair["changed"]
    assert pair["steps"] == {"changed": 0, "compared": 4, "errors": 0}
    assert pair["final_answers"]["changed"] == 0 and pair["final_answers"]["compared"] == 2
    assert pair["questions"] == {"changed": 0, "compared": 2, "errors": 0, "first_changed_step": {}}
    assert pair["run_a"]["stack_hashes"] == pair["run_b"]["stack_hashes"]
    assert len(pair["run_a"]["stack_hashes"]) == len(pair["run_a"]["system_fingerprints"]) == 1
    human = lab.cli("diff", *map(str, lab.runs), "--label", "Local")
    assert human.returncode == 0 and "Local" in human.stdout and "0 / 4" in human.stdout


def test_perturbed_weights_change_steps_and_the_diff_and_check_say_which(lab, noisy_model):
    with lab.serve(noisy_model):
        code, moved = lab.check()
    assert code == 1
    verdicts = {c: r["verdict"] for c, r in moved.items()}
    # each step against its own baseline: a changed upstream output never starts a new baseline
    assert "baseline" not in verdicts.values() and "error" not in verdicts.values(), verdicts
    first = next(s for s in STEPS if verdicts[s] in DRIFT)
    step = first.partition(":")[2]
    final = moved["plan:answer"]
    assert final["first_diverged_step"] == step
    assert f"step {step!r} ({STEPS.index(first) + 1} of 3) diverged first" in final["reasons"]
    assert all(moved[s]["first_diverged_step"] is None for s in STEPS[:-1])

    code, pair = lab.diff(lab.runs[0], lab.runs[-1])
    assert code == 1 and pair["changed"]
    assert 0 < pair["steps"]["changed"] <= pair["steps"]["compared"] == 4, pair["steps"]
    tokens_moved = [s for s in [*STEPS, "plain"] if verdicts[s] in ("answer-drift", "regression")]
    assert pair["steps"]["changed"] == len(tokens_moved), (pair["steps"], verdicts)
    a, b = pair["run_a"]["stack_hashes"], pair["run_b"]["stack_hashes"]
    assert len(a) == len(b) == 1 and a != b  # one serving stack per run, and not the same one
    if any(s.startswith("plan:") for s in tokens_moved):
        assert pair["questions"]["first_changed_step"]["plan"] in STEPS
