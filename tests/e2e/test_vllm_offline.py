"""Kind ``vllm-offline``: canaries through an in-process ``vllm.LLM`` with the configured engine args.

The end-to-end test goes through the real user path (``python -m canaryd check --json`` in a subprocess,
which also keeps vLLM's engine out of pytest) and walks one history: baseline, identical,
then one engine arg changed at a time. Each step starts an engine, so there are four. The backend's ``env``
runs the engine in canaryd's process (``VLLM_ENABLE_V1_MULTIPROCESSING = "0"``), as a harness may: on a CPU
vLLM spawns its processes, each importing torch and vLLM anew, so a step costs one import, not three.
The backend's pieces that need no engine are in tests/unit/test_vllm_offline.py.
"""

import hashlib
import json
import os
import sqlite3
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from tests.unit.test_vllm_offline import CONFIG, ENGINE, SUITE


class Lab:
    def __init__(self, root: Path, model: Path) -> None:
        self.root, self.model = root, model
        (root / "suite.toml").write_text(SUITE)

    def check(self, **engine: str) -> tuple[int, dict, float]:
        args = {**ENGINE, **engine}
        (self.root / "canaryd.toml").write_text(
            CONFIG.format(model=self.model, engine=", ".join(f"{k} = {v}" for k, v in args.items()))
        )
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "XDG_CACHE_HOME": str(self.root / "cache")}
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it must come from the backend's env table
        p = subprocess.run(
            [sys.executable, "-m", "canaryd", "-c", str(self.root / "canaryd.toml"), "check", "--json"],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert "Traceback" not in p.stderr, p.stderr[-4000:]
        try:
            report = json.loads(p.stdout)  # vLLM's logs must not reach stdout
        except ValueError:
            pytest.fail(f"stdout is not JSON: {p.stdout[:2000]}\n{p.stderr[-3000:]}")
        return p.returncode, report, p

    def stacks(self) -> list[dict[str, str]]:
        db = sqlite3.connect(self.root / "state" / "canaryd.db")
        rows = db.execute(
            "select s.fields from observation o join stack s on s.hash = o.stack_hash "
            "where o.canary_id = 'chat-add' order by o.id"
        ).fetchall()
        return [json.loads(r[0]) for r in rows]


def verdicts(report: dict) -> dict[str, str]:
    return {r["canary"]: r["verdict"] for r in report["results"]}


def changed_fields(report: dict) -> set[str]:
    return {c["field"] for r in report["results"] for c in r["stack_changes"]}


@pytest.mark.vllm
def test_offline_engine_baseline_identical_then_one_engine_arg_changed(tmp_path, tiny_model):
    lab = Lab(tmp_path, tiny_model)

    code, report, p = lab.check()
    assert code == 0, p.stderr[-3000:]
    assert set(verdicts(report).values()) == {"baseline"}, report
    assert all(r["error_kind"] is None for r in report["results"])

    code, report, _ = lab.check()
    assert code == 0 and set(verdicts(report).values()) == {"identical"}, report

    stack = lab.stacks()[0]
    files = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in tiny_model.iterdir()}
    template = json.loads((tiny_model / "tokenizer_config.json").read_text())["chat_template"]
    expected = {
        "backend.kind": "vllm-offline",
        "vllm.version": "0.32.0",
        "packages.vllm-cpu": "0.32.0",
        "torch.version": metadata.version("torch"),
        "torch.build.cuda": "",
        "torch.cuda_available": "False",
        "engine.model_config.dtype": "float32",
        "engine.model_config.max_model_len": "512",
        "engine.model_config.enforce_eager": "True",
        "engine.model_config.seed": "0",
        "engine.cache_config.cache_dtype": "auto",
        "engine.device_config.device_type": "cpu",
        "env.VLLM_CPU_KVCACHE_SPACE": "1",
        "env.VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "model.chat_template_sha256": hashlib.sha256(template.encode()).hexdigest(),
        **{f"model.files.{name}": digest for name, digest in files.items()},
    }
    assert {k: stack.get(k) for k in expected} == expected
    assert stack["response.system_fingerprint"].startswith("vllm-0.32.0-")
    assert len(stack["template.tokens_sha256"]) == 16 and int(stack["template.token_count"]) > 5
    assert stack["torch.cpu_capability"] and stack["python.version"] and stack["os.kernel"]
    assert not any("KEY" in k or "TOKEN" in k.split("_") for k in stack)

    # the seed: one field moves, vLLM's fingerprint does not (it ignores the seed): a stack change
    code, report, _ = lab.check(seed="1")
    assert code == 1 and set(verdicts(report).values()) == {"stack-change"}, report
    assert changed_fields(report) == {"engine.model_config.seed"}
    assert not any(r["fingerprint_changed"] for r in report["results"])
    why = subprocess.run(
        [
            sys.executable,
            "-m",
            "canaryd",
            "-c",
            str(lab.root / "canaryd.toml"),
            "explain",
            "offline",
            "chat-add",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert why.returncode == 0, why.stderr
    flip = json.loads(why.stdout)["flips"][0]
    assert [c["field"] for c in flip["stack_changes"]] == [
        "engine.model_config.seed"
    ]  # one change, named alone
    assert "engine.model_config.seed" in flip["suggestion"]

    # dtype: that field, and the fingerprint that hashes it; the numbers move too
    code, report, _ = lab.check(dtype='"bfloat16"')
    assert code == 1, report
    assert set(verdicts(report).values()) <= {"logprob-drift", "answer-drift"}, report
    assert changed_fields(report) == {"engine.model_config.dtype", "response.system_fingerprint"}
    dtype = {
        (c["before"], c["after"])
        for r in report["results"]
        for c in r["stack_changes"]
        if c["field"] == "engine.model_config.dtype"
    }
    assert dtype == {("float32", "bfloat16")}
