"""A real `inspect eval` of a tiny task (tests/fixtures/inspect/arith.py, 20 samples) with canaryd's hook,
installed through the ``inspect_ai`` entry point, against real vLLM CPU servers behind a balancer whose
pool the test sets: one float32 server, then one bfloat16, then both. Nothing between Inspect and canaryd
is mocked.

* hook off (no ``CANARYD_CONFIG``): the log has no canaryd metadata and no record is written;
* the unchanged stack: the log's ``eval.metadata["canaryd"]`` names the stack, the pin matches, the stack
  held, and one serving configuration answered all 20 samples; the record lies beside the log;
* a dtype switch between the pin and the run: the task ends as an error before any sample is sent,
  its error saying canaryd refused it;
* both servers: the metadata names two configurations with their sample counts, and a warning.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from inspect_ai.log import list_eval_logs, read_eval_log

from canaryd.lab.vllm_process import free_port
from tests.e2e.test_fleet_vllm import server
from tests.harness.balancer import Balancer
from tests.harness.lab import Lab

pytestmark = pytest.mark.vllm

TASK = Path(__file__).resolve().parents[1] / "fixtures" / "inspect" / "arith.py"
SUITE = """
[suite]
name = "gate"
[defaults]
max_tokens = 6
[[canary]]
id = "add"
messages = [{ role = "user", content = "What is 17 + 25?" }]
[[canary]]
id = "capital"
messages = [{ role = "user", content = "Capital of France?" }]
"""
CONFIG = """
state_dir = "state"
suites = ["suite.toml"]
[[backends]]
name = "served"
kind = "openai"
base_url = "http://127.0.0.1:{port}/v1"
model = "tiny"
timeout_s = 60
concurrency = 1
"""


@pytest.fixture(scope="module")
def bed(tmp_path_factory, tiny_model):
    port = free_port()
    lab = Lab(tmp_path_factory.mktemp("inspect"), SUITE, CONFIG.replace("{port}", str(port)))
    with (
        server(lab, "fp32", tiny_model, "float32") as fp32,
        server(lab, "bf16", tiny_model, "bfloat16") as bf16,
        Balancer({fp32.port: 1.0}, port=port, seed=7) as lb,
    ):
        yield lab, lb, fp32, bf16


def inspect_eval(lab: Lab, logs: Path, lb: Balancer, **env: str) -> Path:
    """`inspect eval` of the tiny task through the balancer; the one log it wrote."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("CANARYD_")}
    p = subprocess.run(
        [
            str(Path(sys.executable).with_name("inspect")),
            "eval",
            str(TASK),
            "--model",
            "openai-api/bed/tiny",
            "--log-dir",
            str(logs),
            "--max-tokens",
            "6",
            "--temperature",
            "0",
            "--display",
            "plain",
            "--max-connections",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=lab.root,
        env={**base, "BED_BASE_URL": f"http://127.0.0.1:{lb.port}/v1", "BED_API_KEY": "none", **env},
    )
    assert "Traceback" not in p.stderr.replace("LimitExceededError", ""), p.stderr[-3000:]
    [log] = list_eval_logs(str(logs))
    return Path(log.name.removeprefix("file://"))


def test_the_hook_records_the_stack_refuses_a_moved_one_and_names_a_mixed_fleet(bed, tmp_path):
    lab, lb, fp32, bf16 = bed
    code, _ = lab.json("check")  # the baselines, on the float32 server
    assert code == 0
    pin = lab.root / "stack.pin.json"
    assert lab.cli("pin", "--out", str(pin)).returncode == 0
    hook = {"CANARYD_CONFIG": str(lab.root / "canaryd.toml")}

    off = inspect_eval(lab, tmp_path / "off", lb)
    assert "canaryd" not in (read_eval_log(str(off)).eval.metadata or {})
    assert not list((tmp_path / "off").glob("*.canaryd-record.*"))

    clean = inspect_eval(lab, tmp_path / "clean", lb, **hook, CANARYD_PIN=str(pin))
    log = read_eval_log(str(clean))
    meta = log.eval.metadata["canaryd"]
    assert log.status == "success" and meta["backend"] == "served"
    assert meta["pin"] is True and meta["held"] is True and meta["warning"] is None
    assert meta["samples"] == 20 and list(meta["configurations"].values()) == [20]
    assert set(meta["verdicts_before"]) <= {"identical", "within-noise"}
    record = json.loads(Path(meta["record"]).read_text())
    assert Path(meta["record"]).parent == clean.parent and record["sessions"][-1]["samples"] == 20
    assert record["stack"]["served"]["stack_hash"] == meta["stack_hash"]["served"]

    lb.set_pool({bf16.port: 1.0})  # a silent dtype restart between the pin and the run
    moved = read_eval_log(str(inspect_eval(lab, tmp_path / "moved", lb, **hook, CANARYD_PIN=str(pin))))
    assert moved.status == "error" and "canaryd" in (moved.error.message if moved.error else "")
    assert not moved.samples  # refused before any sample was sent

    lb.set_pool({fp32.port: 1.0, bf16.port: 1.0})
    mixed = read_eval_log(str(inspect_eval(lab, tmp_path / "mixed", lb, **hook)))
    meta = mixed.eval.metadata["canaryd"]
    assert len(meta["configurations"]) == 2 and sum(meta["configurations"].values()) == 20
    assert "2 serving configurations answered the samples" in meta["warning"]
