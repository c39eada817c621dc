"""Chained canaries and `canaryd diff` against a real vLLM (CPU) server serving the tiny model.

Two unchanged runs of a three-step plan and a plain canary diff to nothing (exit 0). Then the server is
restarted on noise-perturbed weights: every step is measured against its own baseline (none re-baselines,
although each later step's rendered prompt changed), the check names the step that diverged first, and
`canaryd diff` between the first and the last run reports the changed steps and one stack per run, a
different one (exit 1). Two server starts in all.
"""

from pathlib import Path

import pytest

from canaryd.probe.chain import DIVERGED
from tests.e2e.conftest import CACHE
from tests.harness.lab import Lab

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

STEPS = ["plan:extract", "plan:map", "plan:answer"]
DRIFT = {v.value for v in DIVERGED}  # the verdicts of a step whose own output moved


class ChainLab(Lab):
    """Keeps the run id of every check, for `canaryd diff`."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, SUITE)
        self.runs: list[int] = []

    def check(self) -> tuple[int, dict[str, dict]]:
        code, doc = self.json("check")
        self.runs.append(doc["results"][0]["run_id"])
        return code, {r["canary"]: r for r in doc["results"]}

    def diff(self, a: int, b: int) -> tuple[int, dict]:
        code, doc = self.json("diff", str(a), str(b))
        return code, doc["pairs"][0]


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> ChainLab:
    return ChainLab(tmp_path_factory.mktemp("chain-e2e"))


@pytest.fixture(scope="module")
def noisy_model(tiny_model: Path) -> Path:
    from canaryd.lab.tinymodel import perturb_weights

    # large enough that greedy tokens change, not just logprobs (checked: the diff must count changed steps)
    return perturb_weights(tiny_model, CACHE / "random-seed0-noise0.5", mode="noise", scale=0.5)


def test_two_unchanged_runs_of_a_plan_diff_to_nothing(lab, tiny_model):
    with lab.serve(tiny_model, link=False):
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
    with lab.serve(noisy_model, link=False):
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
