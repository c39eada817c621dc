"""The evaluation harnesses under canaryd, against real vLLM CPU servers (float32 and bfloat16, the same
tiny weights) behind a balancer whose pool each test sets. Nothing between a harness and canaryd is mocked.

A real `inspect eval` of a tiny task (tests/harness/inspect_arith.py, 20 samples) with canaryd's hook,
installed through the ``inspect_ai`` entry point:

* hook off (no ``CANARYD_CONFIG``): the log has no canaryd metadata and no record is written;
* the unchanged stack: the log's ``eval.metadata["canaryd"]`` names the stack, the pin matches, the stack
  held, and one serving configuration answered all 20 samples; the record lies beside the log;
* a dtype switch between the pin and the run: the task ends as an error before any sample is sent,
  its error saying canaryd refused it;
* both servers: the metadata names two configurations with their sample counts, and a warning.

A real `lm_eval run` (``local-completions``) of a tiny local task under ``canaryd preflight``: the record
lies beside lm-eval's results file and cites it and its task hashes; a moved stack refuses the run.
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

TASK = Path(__file__).resolve().parents[1] / "harness" / "inspect_arith.py"
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
    (lab.root / TASK.name).write_text(TASK.read_text())
    p = subprocess.run(
        [
            str(Path(sys.executable).with_name("inspect")),
            "eval",
            TASK.name,  # Inspect takes a task file relative to its working directory
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
    assert not list((tmp_path / "off").glob("canaryd-record.*"))

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

    # the bfloat16 server is meant to serve beside the float32 one: accepted, it is a configuration of its own
    assert lab.cli("baseline", "accept").returncode == 0
    lb.set_pool({fp32.port: 1.0, bf16.port: 1.0})
    mixed = read_eval_log(str(inspect_eval(lab, tmp_path / "mixed", lb, **hook)))
    meta = (mixed.eval.metadata or {}).get("canaryd")
    assert meta is not None, mixed.error
    assert len(meta["configurations"]) == 2 and sum(meta["configurations"].values()) == 20
    assert "2 serving configurations answered the samples" in meta["warning"]


LM_TASK = """task: tiny_arith
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
"""


def lm_eval(lab: Lab, lb: Balancer, pin: Path, out: Path, tasks: Path) -> subprocess.CompletedProcess:
    """`canaryd preflight` around `lm_eval run`, as docs/harnesses.md shows it."""
    args = f"base_url=http://127.0.0.1:{lb.port}/v1/completions,model=tiny,tokenizer_backend=None,"
    args += "tokenized_requests=False,num_concurrent=2"
    command = [
        str(Path(sys.executable).with_name("lm_eval")),
        "run",
        "--model",
        "local-completions",
        "--model_args",
        args,
        "--tasks",
        "tiny_arith",
        "--include_path",
        str(tasks),
        "--output_path",
        str(out),
        "--log_samples",  # lm-eval computes its task hashes from the samples it logs
    ]
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(lab.root / "hf")}
    return lab.cli("preflight", "--pin", str(pin), "--out", str(out), "--", *command, env=env)


def test_lm_eval_under_preflight_records_beside_its_results_and_a_moved_stack_refuses_it(bed, tmp_path):
    lab, lb, fp32, bf16 = bed
    lb.set_pool({fp32.port: 1.0})
    assert lab.json("check")[0] == 0
    pin = tmp_path / "stack.pin.json"
    assert lab.cli("pin", "--out", str(pin)).returncode == 0
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    data = tasks / "tiny_arith.jsonl"
    data.write_text(
        "".join(json.dumps({"question": f"{i} + {i}", "answer": str(2 * i)}) + "\n" for i in range(5))
    )
    (tasks / "tiny_arith.yaml").write_text(LM_TASK.format(data=data))

    ran = lm_eval(lab, lb, pin, tmp_path / "out", tasks)
    assert ran.returncode == 0, ran.stderr[-3000:]
    [results] = (tmp_path / "out").rglob("results_*.json")  # the record beside it is not one
    record_file = results.with_name(f"canaryd-record.{results.stem}.json")
    record = json.loads(record_file.read_text())
    cited = record["command"]["results"]
    doc = json.loads(results.read_text())
    assert cited["results"] == str(results) and cited["task_hashes"] == doc["task_hashes"] != {}
    assert cited["tasks"] == ["tiny_arith"] and cited["samples"] == 5
    session = record["sessions"][-1]
    assert (session["harness"], session["task"], session["samples"], session["held"]) == (
        "lm-eval",
        "tiny_arith",
        5,
        True,
    )
    assert results.with_name(f"canaryd-record.{results.stem}.md").is_file()

    lb.set_pool({bf16.port: 1.0})  # the stack moved since the pin
    refused = lm_eval(lab, lb, pin, tmp_path / "refused", tasks)
    assert refused.returncode == 1, refused.stderr[-3000:]
    assert not list((tmp_path / "refused").rglob("results_*.json"))  # lm-eval never ran
