"""A real LiteLLM proxy (tests/engines/install_litellm.sh) in front of a real vLLM (CPU) server, probed by
canaryd's ``litellm`` kind beside a direct ``openai`` backend on the same vLLM.

Two model groups on one upstream: ``tiny`` passes everything through; ``tiny-dropping`` is configured
with ``drop_params`` and ``additional_drop_params = [logprobs, top_logprobs]``, so the proxy answers 200
without the logprobs it was asked for. canaryd must get the same answers and logprobs through the first as
directly, name the upstream that served them, and report the second's dropping, once, as what it is.
One vLLM start and one proxy start for the module.
"""

import json
import os
import signal
import sqlite3
import subprocess
import time

import httpx2
import pytest

from tests.e2e.conftest import REPO
from tests.harness.lab import Lab

pytestmark = pytest.mark.vllm
LITELLM = REPO / ".cache" / "engines" / "litellm" / "bin" / "litellm"
MASTER = "sk-litellm-e2e-master-5e0a"  # the proxy's key: must be stored nowhere

SUITE = """
[suite]
name = "gw"
[defaults]
max_tokens = 8
top_logprobs = 3
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
name = "direct"
kind = "openai"
base_url = "http://127.0.0.1:{port}/v1"
model = "tiny"
[[backends]]
name = "gw"
kind = "litellm"
base_url = "http://127.0.0.1:{proxy}/v1"
model = "tiny"
api_key_env = "LITELLM_E2E_KEY"
[[backends]]
name = "gw-drop"
kind = "litellm"
base_url = "http://127.0.0.1:{proxy}/v1"
model = "tiny-dropping"
api_key_env = "LITELLM_E2E_KEY"
"""

PROXY_CONFIG = """\
model_list:
  - model_name: tiny
    litellm_params:
      model: hosted_vllm/tiny
      api_base: http://127.0.0.1:{port}/v1
  - model_name: tiny-dropping
    litellm_params:
      model: hosted_vllm/tiny
      api_base: http://127.0.0.1:{port}/v1
      drop_params: true
      additional_drop_params: ["logprobs", "top_logprobs"]
general_settings:
  master_key: {master}
"""


class Gateway:
    """``litellm --config`` on a free port, in its own process group."""

    def __init__(self, root, upstream_port: int, port: int) -> None:
        if not LITELLM.is_file():
            pytest.fail(f"{LITELLM} is missing: run tests/engines/install_litellm.sh")
        cfg = root / "litellm.yaml"
        cfg.write_text(PROXY_CONFIG.format(port=upstream_port, master=MASTER))
        self.port = port
        self.log = root / "litellm.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [str(LITELLM), "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=root,
            )

    def wait(self, timeout: float = 240.0) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                if (
                    httpx2.get(f"http://127.0.0.1:{self.port}/health/liveliness", timeout=2).status_code
                    == 200
                ):
                    return time.monotonic() - t0
            except httpx2.TransportError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"litellm not up after {timeout:.0f}s: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="module")
def lab(tmp_path_factory, tiny_model):
    from canaryd.lab.vllm_process import free_port

    root = tmp_path_factory.mktemp("litellm")
    proxy = free_port()
    lab = Lab(root, SUITE, CONFIG.replace("{proxy}", str(proxy)), env={"LITELLM_E2E_KEY": MASTER})
    gateway = Gateway(root, lab.port, proxy)  # it starts while vLLM does
    try:
        with lab.serve(tiny_model):
            print(f"\nlitellm proxy up {gateway.wait():.0f}s after vLLM")
            yield lab
    finally:
        gateway.stop()


def stacks(lab: Lab) -> dict[str, dict]:
    db = sqlite3.connect(lab.root / "state" / "canaryd.db")
    rows = db.execute(
        "select o.backend, s.fields from observation o join stack s on s.hash = o.stack_hash order by o.id"
    )
    return {backend: json.loads(fields) for backend, fields in rows}


def by(report: dict, backend: str) -> dict[str, dict]:
    return {r["canary"]: r for r in report["results"] if r["backend"] == backend}


def test_through_the_gateway_the_same_answers_and_logprobs_and_the_upstream_named(lab):
    p = lab.cli("probe", "--json")
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    direct, gw, drop = by(report, "direct"), by(report, "gw"), by(report, "gw-drop")
    assert {r["verdict"] for r in report["results"]} == {"baseline"}
    for canary in direct:
        assert gw[canary]["text"] == direct[canary]["text"] == drop[canary]["text"]
    assert {r["basis"] for r in gw.values()} == {"logprobs"}
    assert {r["basis"] for r in drop.values()} == {"text"}  # judged on what it has, and says so

    # the logprobs came through untouched: the gateway's tokens are the server's own
    export = lab.cli("export", "--run", str(next(iter(gw.values()))["run_id"]))
    lines = [json.loads(x) for x in export.stdout.splitlines()]
    tokens = {(o["backend"], o["canary_id"]): o["tokens"] for o in lines if o.get("tokens")}
    direct_run = lab.cli("export", "--run", str(next(iter(direct.values()))["run_id"]))
    for x in direct_run.stdout.splitlines():
        o = json.loads(x)
        if o["backend"] == "direct":
            assert tokens[("gw", o["canary_id"])] == o["tokens"]

    s = stacks(lab)
    upstream = f"http://127.0.0.1:{lab.port}/v1"
    assert s["gw"]["gateway.model_name"] == "hosted_vllm/tiny" and s["gw"]["gateway.api_base"] == upstream
    assert s["gw"]["gateway.version"] == "1.110.2" and s["gw"]["gateway.logprobs"] == "passed"
    assert s["gw"]["gateway.upstream_server"] == "uvicorn"  # vLLM's own Server header, forwarded
    assert s["gw"]["gateway.model_id"] != s["gw-drop"]["gateway.model_id"]
    (dep,) = s["gw-drop"]["gateway.deployments"].split(",")
    assert s["gw-drop"][f"gateway.deployment.{dep}.drops"] == "logprobs,top_logprobs"
    assert s["gw-drop"]["gateway.logprobs"] == "dropped"
    assert not any(k.endswith(".drops") for k in s["gw"])
    # reported once each, naming the backend; never the proxy's key
    assert p.stderr.count("gateway_drops_params") == 1 and p.stderr.count("gateway_dropped_logprobs") == 1
    assert "gw-drop" in p.stderr
    for text in (p.stdout, p.stderr, export.stdout, "\n".join(map(str, s.values()))):
        assert MASTER not in text


def test_an_unchanged_gateway_is_identical_on_the_evidence_it_gives(lab):
    code, report = lab.json("check")
    assert code == 0, report
    assert {(r["backend"], r["verdict"]) for r in report["results"]} == {
        ("direct", "identical"),
        ("gw", "identical"),
        ("gw-drop", "identical"),
    }
    assert {r["basis"] for r in by(report, "gw-drop").values()} == {"text"}
