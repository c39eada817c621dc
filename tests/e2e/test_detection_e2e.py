"""Calibrated detection against a real vLLM (CPU) server: no false alarm on honest restarts, and each
silent change caught in one probe cycle, including one that leaves every greedy answer unchanged.

The steps run in order on one history: baseline and calibration on fp32, an unchanged restart, then
the dtype, an int8 round trip of the weights, and a weight perturbation too small to move a token.
"""

import json
import sqlite3
from pathlib import Path

import pytest

from tests.harness.lab import Lab

pytestmark = pytest.mark.vllm

SUITE = """
[suite]
name = "detect"
[defaults]
max_tokens = 8
top_logprobs = 5
[[canary]]
id = "add"
messages = [{ role = "user", content = "What is 17 + 25?" }]
[[canary]]
id = "capital"
messages = [{ role = "user", content = "Capital of France?" }]
[[canary]]
id = "colors"
prompt = "The three primary colors of light are"
[[canary]]
id = "count"
prompt = "1, 2, 3,"
"""

CONFIG = """
state_dir = "state"
suites = ["suite.toml"]
[compare]
calibration_k = 6
calibration_batch_sizes = [1, 4]
[[backends]]
name = "local"
kind = "vllm"
base_url = "http://127.0.0.1:{port}/v1"
model = "tiny"
timeout_s = 30
"""

DRIFT = {"logprob-drift", "answer-drift", "regression"}


class DetectLab(Lab):
    def check(self) -> tuple[int, list[dict]]:
        code, doc = self.json("check")
        return code, doc["results"]


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> DetectLab:
    return DetectLab(tmp_path_factory.mktemp("detect"), SUITE, CONFIG)


@pytest.fixture(scope="module")
def nudged_model(tiny_model: Path) -> Path:
    from canaryd.lab.tinymodel import perturb_weights

    from .conftest import CACHE

    return perturb_weights(tiny_model, CACHE / "random-seed0-noise1e-3", mode="noise", scale=1e-3, seed=1)


def test_calibration_on_fp32_measures_a_zero_noise_floor(lab, tiny_model):
    with lab.serve(tiny_model):
        first = lab.cli("probe", "--json")
        assert first.returncode == 0, first.stderr
        table = lab.cli("baseline", "calibrate", "-k", "2", "--batch-sizes", "1")
        assert table.returncode == 0 and "exact" in table.stdout, table.stderr
        cal = lab.cli("baseline", "calibrate", "--json")  # replaces the k=2 models
        assert cal.returncode == 0, cal.stderr
        rows = json.loads(cal.stdout)["calibrations"]
        assert {r["canary"] for r in rows} == {"add", "capital", "colors", "count"}
        for r in rows:  # 6 probes: 3 alone, 3 beside 3 fillers; the CPU engine is batch-invariant
            assert r["saved"] and r["k"] == 6 and r["errors"] == 0
            assert (r["regime"], r["signatures"], r["threshold"]) == ("exact", 1, 0.0)
        code, results = lab.check()
        assert code == 0
        for r in results:
            assert r["verdict"] == "identical"
            ev = r["evidence"]
            assert ev["method"] == "exact" and ev["p_value"] == 1.0 and not ev["out"]


def test_an_unchanged_restart_raises_no_alarm(lab, tiny_model):
    with lab.serve(tiny_model):
        code, results = lab.check()
    assert code == 0, [r["reasons"] for r in results]
    assert {r["verdict"] for r in results} == {"identical"}
    assert all(r["evidence"]["statistic"] == 0.0 for r in results)


def assert_detected(results: list[dict], *, tokens_kept: bool) -> None:
    verdicts = {r["canary"]: r["verdict"] for r in results}
    assert set(verdicts.values()) <= DRIFT and verdicts, verdicts
    for r in results:
        ev = r["evidence"]
        assert ev["out"] and ev["statistic"] > ev["threshold"] == 0.0
        assert ev["p_value"] == pytest.approx(1 / 7)  # 1/(k+1): beyond all k = 6 honest probes
        assert ev["detail"]["max_abs_dlogprob"] > 0
    if tokens_kept:
        assert set(verdicts.values()) == {"logprob-drift"}
        assert all(r["text_identical"] for r in results)


def detector(lab: Lab) -> tuple[int, list[str]]:
    db = sqlite3.connect(lab.root / "state" / "canaryd.db")
    alarm, pending = db.execute("select alarm, pending from detector where backend = 'local'").fetchone()
    return alarm, sorted(json.loads(pending))


def test_bf16_is_detected_in_one_cycle(lab, tiny_model):
    with lab.serve(tiny_model, dtype="bfloat16"):
        code, results = lab.check()
    assert code == 1
    assert_detected(results, tokens_kept=False)
    # 4 canaries at K = 6 cannot prove arl = 1e4 in one cycle: the alarm waits for a second that moves
    assert detector(lab) == (0, ["add", "capital", "colors", "count"])


def test_int8_round_trip_is_detected_in_one_cycle(lab, int8_model):
    with lab.serve(int8_model):
        code, results = lab.check()
    assert code == 1
    assert_detected(results, tokens_kept=False)
    assert detector(lab)[0] == 1  # the canaries moved again: the alarm latches


def test_a_perturbation_that_keeps_every_greedy_answer_is_detected_in_one_cycle(lab, nudged_model):
    with lab.serve(nudged_model):
        code, results = lab.check()
    assert code == 1
    assert_detected(results, tokens_kept=True)
    assert detector(lab) == (1, ["add", "capital", "colors", "count"])
