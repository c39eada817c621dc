"""Serving configurations against real vLLM CPU servers: one URL balanced at random over two servers with
the same tiny weights, one float32 and one bfloat16 (each its own ``system_fingerprint``), probed with the
plain ``openai`` kind through the CLI, as a new user would.

Unchanged passes give no drift and report two configurations; the bfloat16 server restarted with int8
round-tripped weights at the same path (same fingerprint) is drift of that configuration only; a third
server (a custom fingerprint) joining the float32 one is reported as new once per canary, then identical.
Four server starts.
"""

import json
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from canaryd.lab.vllm_process import VLLMServer
from canaryd.stack import configuration_of
from tests.harness.balancer import Balancer
from tests.harness.lab import Lab

pytestmark = pytest.mark.vllm

PROMPTS = [
    "What is 17 + 25?",
    "Capital of France?",
    "Count from 1 to 5.",
    "Name a colour.",
    "Say hello.",
    "What day comes after Monday?",
    "Spell cat.",
    "Is water wet?",
]
SUITE = '[suite]\nname = "fleet"\n[defaults]\nmax_tokens = 8\n' + "".join(
    f'[[canary]]\nid = "c{i}"\nmessages = [{{ role = "user", content = "{p}" }}]\n'
    for i, p in enumerate(PROMPTS)
)
CONFIG = """
state_dir = "state"
suites = ["suite.toml"]
[[backends]]
name = "fleet"
kind = "openai"
base_url = "http://127.0.0.1:{port}/v1"
model = "tiny"
timeout_s = 60
concurrency = 1
"""


def server(lab: Lab, name: str, model: Path, dtype: str, port: int | None = None, *extra: str) -> VLLMServer:
    """vLLM serving ``model`` through the symlink ``name`` (a swap of weights keeps the path)."""
    link = lab.root / name
    link.unlink(missing_ok=True)
    link.symlink_to(model)
    return VLLMServer(
        link,
        port=port,
        dtype=dtype,
        extra_args=["--enforce-eager", *extra],
        log_path=lab.root / f"vllm-{name}-{model.name}.log",
    )


def passes(lab: Lab, n: int) -> list[tuple[int, dict]]:
    out = []
    for _ in range(n):
        code, doc = lab.json("check")
        assert code in (0, 1), doc
        out.append((code, doc))
    return out


def results(runs: list[tuple[int, dict]]) -> list[dict]:
    return [r for _, doc in runs for r in doc["results"]]


def fingerprint_of(srv: VLLMServer) -> str:
    """The ``system_fingerprint`` the server answers with, asked directly."""
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    req = urllib.request.Request(
        f"{srv.base_url}/chat/completions", body.encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as reply:
        return json.load(reply)["system_fingerprint"]


DRIFT = ("regression", "answer-drift", "logprob-drift", "stack-change")


def test_a_random_two_configuration_fleet_then_a_change_inside_one_then_a_third(
    tmp_path, tiny_model, int8_model
):
    lab = Lab(tmp_path, SUITE, CONFIG)
    a = server(lab, "a", tiny_model, "float32")
    b = server(lab, "b", tiny_model, "bfloat16")
    with a, b, Balancer({a.port: 1, b.port: 1}, port=lab.port, seed=1) as lb:
        fp32, bf16 = (configuration_of({"response.system_fingerprint": fingerprint_of(s)}) for s in (a, b))
        assert fp32 != bf16  # the dtype is in vLLM's fingerprint
        # 1. one baseline pass and ten unchanged ones: no drift, two configurations
        runs = passes(lab, 11)
        seen = results(runs)
        assert [code for code, _ in runs] == [0] * 11, Counter(r["verdict"] for r in seen)
        assert not [r for r in seen if r["verdict"] in DRIFT]
        assert {r["configuration"] for r in seen} == {fp32, bf16}
        assert max(doc["configurations"]["fleet"]["count"] for _, doc in runs) == 2
        counts = Counter(r["verdict"] for r in seen)
        assert counts["baseline"] == len(PROMPTS) and counts["new-configuration"] == len(PROMPTS)
        assert counts["identical"] == 10 * len(PROMPTS) - len(PROMPTS)
        assert min(lb.served[a.port], lb.served[b.port]) > 10

        # 2. the bfloat16 server comes back with int8 round-tripped weights at the same path
        b.stop()
        with server(lab, "b", int8_model, "bfloat16", b.port):
            moved = results(passes(lab, 4))
        assert {r["configuration"] for r in moved} == {fp32, bf16}  # the same configurations
        drifted = [r for r in moved if r["verdict"] != "identical"]
        assert drifted and {r["configuration"] for r in drifted} == {bf16}
        assert {r["verdict"] for r in drifted} <= set(DRIFT)
        assert {r["verdict"] for r in moved if r["configuration"] == fp32} == {"identical"}

        # 3. a third server joins (a custom fingerprint) beside the float32 one, taking most requests
        custom = ("--fingerprint-mode", "custom", "--fingerprint-value", "third")
        with server(lab, "c", tiny_model, "float32", None, *custom) as c:
            third = configuration_of({"response.system_fingerprint": "third"})
            lb.set_pool({a.port: 1, c.port: 3})
            joined = passes(lab, 4)
        assert [code for code, _ in joined] == [0] * 4
        on_third = [r for r in results(joined) if r["configuration"] == third]
        firsts = [r for r in on_third if r["verdict"] == "new-configuration"]
        assert sorted(r["canary"] for r in firsts) == sorted(
            f"c{i}" for i in range(len(PROMPTS))
        )  # once each
        assert {r["verdict"] for r in on_third} == {"new-configuration", "identical"}
        assert {r["verdict"] for r in results(joined) if r["configuration"] == fp32} == {"identical"}
        assert {c for _, doc in joined for c in doc["configurations"]["fleet"]["new"]} == {third}
        for r in firsts:  # compared with the most recent other baseline: float32 answers the same
            against = r["reasons"][1]
            assert against == f"against configuration {fp32} it would be identical" or (
                against.startswith(f"against configuration {bf16} it would be ")
                and "identical" not in against
            ), against
