"""Serving configurations against real vLLM CPU servers: two servers with the same tiny weights, one float32
and one bfloat16 (each its own ``system_fingerprint``), behind two balancers at once, probed through the
CLI as a new user would: a Python random balancer with the plain ``openai`` kind, and a real nginx
(``random``) with the ``vllm`` kind, whose snapshot (``/metrics``' kv-cache sizes, ``/v1/models``' root,
``/version``) nginx answers from either server: a fleet's snapshot belongs to its members
(`canaryd.fleet`).

Unchanged passes give no drift of any kind, exit 0, and report two configurations; the bfloat16 server
restarted with int8 round-tripped weights at the same path (same fingerprint) is drift of that
configuration only; then restarted in float32 (another dtype: a new fingerprint), it is a new
configuration once per canary, then identical, named by nginx's backend as the one that replaced the
bfloat16 configuration. Four server starts.
"""

import json
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from canaryd.lab.vllm_process import VLLMServer, free_port
from canaryd.stack import configuration_of
from tests.harness.balancer import Balancer
from tests.harness.lab import Lab
from tests.harness.nginx import Nginx

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
[[backends]]
name = "nginx"
kind = "vllm"
base_url = "http://127.0.0.1:{nginx}/v1"
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


def results(runs: list[tuple[int, dict]], backend: str = "fleet") -> list[dict]:
    return [r for _, doc in runs for r in doc["results"] if r["backend"] == backend]


def fingerprint_of(srv: VLLMServer) -> str:
    """The ``system_fingerprint`` the server answers with, asked directly."""
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    req = urllib.request.Request(
        f"{srv.base_url}/chat/completions", body.encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as reply:
        return json.load(reply)["system_fingerprint"]


DRIFT = ("regression", "answer-drift", "logprob-drift", "stack-change")


def test_a_random_two_configuration_fleet_then_a_change_inside_one_then_a_dtype_restart(
    tmp_path, tiny_model, int8_model
):
    nginx_port = free_port()
    lab = Lab(tmp_path, SUITE, CONFIG.replace("{nginx}", str(nginx_port)))
    a = server(lab, "a", tiny_model, "float32")
    b = server(lab, "b", tiny_model, "bfloat16")
    with (  # the balancers bind first: a port picked long before it is bound can be taken meanwhile
        Balancer({a.port: 1, b.port: 1}, port=lab.port, seed=1) as lb,
        Nginx(tmp_path / "nginx", [a.port, b.port], port=nginx_port) as nginx,
        a,
        b,
    ):
        fp32, bf16 = (configuration_of({"response.system_fingerprint": fingerprint_of(s)}) for s in (a, b))
        assert fp32 != bf16  # the dtype is in vLLM's fingerprint
        # 1. one baseline pass and ten unchanged ones: no drift of any kind, exit 0, two configurations
        runs = passes(lab, 11)
        for backend in ("fleet", "nginx"):
            seen = results(runs, backend)
            assert [code for code, _ in runs] == [0] * 11, Counter(r["verdict"] for r in seen)
            assert not [r for r in seen if r["verdict"] in DRIFT]
            assert {r["configuration"] for r in seen} == {fp32, bf16}
            assert max(doc["configurations"][backend]["count"] for _, doc in runs) == 2
            counts = Counter(r["verdict"] for r in seen)
            assert counts["baseline"] == len(PROMPTS) and counts["new-configuration"] == len(PROMPTS)
            assert counts["identical"] == 10 * len(PROMPTS) - len(PROMPTS)
        assert min(lb.served[a.port], lb.served[b.port]) > 10
        assert min(nginx.served().get(p, 0) for p in (a.port, b.port)) > 10
        # nginx answered the vllm kind's snapshot from both servers (bfloat16 has twice the kv-cache
        # blocks): recorded, set aside, never a stack change
        aside = [why for r in results(runs, "nginx") for why in r["reasons"] if "server-side snapshot" in why]
        assert any("num_gpu_blocks" in why for why in aside), aside[:3]

        # 2. the bfloat16 server comes back with int8 round-tripped weights at the same path
        b.stop()
        with server(lab, "b", int8_model, "bfloat16", b.port):
            moved_runs = passes(lab, 4)
        for backend in ("fleet", "nginx"):
            moved = results(moved_runs, backend)
            assert {r["configuration"] for r in moved} == {fp32, bf16}  # the same configurations
            drifted = [r for r in moved if r["verdict"] != "identical"]
            assert drifted and {r["configuration"] for r in drifted} == {bf16}
            assert {r["verdict"] for r in drifted} <= set(DRIFT)
            assert {r["verdict"] for r in moved if r["configuration"] == fp32} == {"identical"}

        # 3. the bfloat16 server is restarted in float32 (a new fingerprint), taking most of the Python
        # balancer's requests (nginx keeps picking at random)
        with server(lab, "b", tiny_model, "float32", b.port) as b32:
            third = configuration_of({"response.system_fingerprint": fingerprint_of(b32)})
            assert third not in (fp32, bf16)  # the dtype (and the path) are in vLLM's fingerprint
            lb.set_pool({a.port: 1, b32.port: 3})
            joined = passes(lab, 4)
        assert [code for code, _ in joined] == [0] * 4
        for backend in ("fleet", "nginx"):
            on_third = [r for r in results(joined, backend) if r["configuration"] == third]
            firsts = [r for r in on_third if r["verdict"] == "new-configuration"]
            # once each canary that met it: every canary behind the Python balancer, which favours it
            met = (
                {r["canary"] for r in on_third}
                if backend == "nginx"
                else {f"c{i}" for i in range(len(PROMPTS))}
            )
            assert sorted(r["canary"] for r in firsts) == sorted(met) and met
            assert {r["verdict"] for r in on_third} == {"new-configuration", "identical"}
            assert {r["verdict"] for r in results(joined, backend) if r["configuration"] == fp32} == {
                "identical"
            }
            assert {c for _, doc in joined for c in doc["configurations"][backend]["new"]} == {third}
            for r in firsts:  # compared with the most recent other baseline: float32 answers the same
                against = r["reasons"][1]
                assert against == f"against configuration {fp32} it would be identical" or (
                    against.startswith(f"against configuration {bf16} it would be ")
                    and "identical" not in against
                ), against
            # the member's old configuration is gone: where the backend first meets the newcomer, it is named
            # as its replacement
            first = [r for r in results(joined[:1], backend) if r["configuration"] == third]
            assert first and {r["verdict"] for r in first} == {"new-configuration"}
            for r in first:
                named = f"configuration {third} replaced configuration {bf16},"
                assert named in r["reasons"][-1], r["reasons"]
