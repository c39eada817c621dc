"""A real vLLM (CPU) server's launch arguments as ``engine.*`` fields, read from its process by the host
probe: the dtype switch (float32 -> bfloat16) and the ``--enforce-eager`` switch each appear as their field,
``explain`` names them before the cache sizes they imply, and the ``--api-key`` the server was started with
is nowhere in the database, the logs, the exports, the record or the metrics. Two server starts."""

import json
import os
import sqlite3
import sys

import pytest

from canaryd.lab.vllm_process import VLLMServer
from tests.harness.lab import Lab

pytestmark = pytest.mark.vllm
KEY = "sk-engine-args-e2e-7d3b91c0"  # recognisable, so the test can prove it is stored nowhere

SUITE = """
[suite]
name = "engine"
[defaults]
max_tokens = 8
[[canary]]
id = "add"
messages = [{ role = "user", content = "What is 17 + 25?" }]
[[canary]]
id = "colors"
prompt = "The three primary colors of light are"
"""

CONFIG = """
state_dir = "state"
suites = ["suite.toml"]
[[backends]]
name = "local"
kind = "vllm"
base_url = "http://127.0.0.1:{port}/v1"
model = "tiny"
api_key_env = "ENGINE_E2E_KEY"
timeout_s = 60
host_probe = {{ python = "{python}" }}
"""


class EngineLab(Lab):
    def __init__(self, root) -> None:
        super().__init__(root, SUITE, CONFIG.replace("{python}", sys.executable), env={"ENGINE_E2E_KEY": KEY})

    def start(self, model, dtype: str, eager: bool) -> VLLMServer:
        """Not `Lab.serve`, which always adds --enforce-eager: here it is the switch under test. Without
        it, ``-O0`` (no compilation either) keeps the start quick: torch.compile's warm-up takes minutes."""
        return VLLMServer(
            model,
            port=self.port,
            dtype=dtype,
            api_key=KEY,
            extra_args=["--enforce-eager"] if eager else ["-O0"],
            log_path=self.root / f"vllm-{dtype}.log",
            startup_timeout=180,
        )

    def stack(self, run: str) -> dict:
        db = sqlite3.connect(self.root / "state" / "canaryd.db")
        (fields,) = db.execute(
            "select s.fields from observation o join stack s on s.hash = o.stack_hash "
            "where o.run_id = ? limit 1",
            (int(run),),
        ).fetchone()
        return json.loads(fields)


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> EngineLab:
    return EngineLab(tmp_path_factory.mktemp("engine-args"))


def metrics_text(lab: EngineLab) -> str:
    """The Prometheus exposition after a pass, as the daemon serves it (in-process, no listener)."""
    from canaryd.canaries import load_suites
    from canaryd.config import load_config
    from canaryd.daemon.metrics import Metrics
    from canaryd.probe.run import built, plan, run_pass
    from canaryd.store import open_store

    os.environ["ENGINE_E2E_KEY"] = KEY
    try:
        config = load_config(lab.root / "canaryd.toml")
        work = plan(config, load_suites([s.path for s in config.suites], config.limits.suite_bytes))
        with built(config, work) as backends:
            store = open_store(config)
            try:
                runs = run_pass(config, backends, work, store)
            finally:
                store.close()
    finally:
        del os.environ["ENGINE_E2E_KEY"]
    m = Metrics()
    for run in runs:
        m.record(run)
    m.publish()
    body, _ = m.exposition()
    return body.decode()


def test_engine_arguments_switches_are_named_first_and_the_key_is_kept_nowhere(lab, tiny_model):
    logs = []
    with lab.start(tiny_model, "float32", eager=True):
        p = lab.cli("--log-level", "debug", "probe", "--json")
        assert p.returncode == 0, p.stderr
        logs += [p.stdout, p.stderr]
        first = json.loads(p.stdout)
        assert {r["verdict"] for r in first["results"]} == {"baseline"}
        stack = lab.stack(first["results"][0]["run_id"])
        assert stack["engine.dtype"] == "float32" and stack["engine.enforce_eager"] == "true"
        assert stack["engine.api_key"] == "<redacted>" and stack["engine.max_model_len"] == "512"
        assert stack["env.VLLM_CPU_KVCACHE_SPACE"] == "1"
        assert "engine.port" not in stack and "engine.host" not in stack and "engine.error" not in stack

    with lab.start(tiny_model, "bfloat16", eager=False):
        p = lab.cli("--log-level", "debug", "check", "--json")
        logs += [p.stdout, p.stderr]
        after = json.loads(p.stdout)
        stack = lab.stack(after["results"][0]["run_id"])
        assert stack["engine.dtype"] == "bfloat16" and "engine.enforce_eager" not in stack
        assert stack["engine.optimization_level"] == "0"
        metrics = metrics_text(lab)
        assert 'canaryd_backend_stack_info{backend="local"' in metrics

    explained = lab.cli("explain", "local")
    logs += [explained.stdout, explained.stderr]
    assert explained.returncode == 0, explained.stderr
    # the whole backend's last stack change, and every flipped canary, lead with the two causes
    _, doc = lab.json("explain", "local")
    advice = [doc["stack"]["suggestion"]] + [f["suggestion"] for f in doc["flips"]]
    assert doc["flips"], "the dtype switch moved no canary"
    for text in advice:
        assert (
            "order (settings first, server-reported fields last): 1. engine.dtype (float32 -> bfloat16); "
            in text
        )
        assert "; 2. engine.enforce_eager (true -> (absent))" in text
    print(f"\nexplain (dtype + enforce-eager switch):\n{explained.stdout}")

    runs = sorted({str(r["run_id"]) for r in first["results"] + after["results"]})
    export = lab.cli("export", *[a for r in runs for a in ("--run", r)])
    record = lab.cli("record", "--since", "1d", "--format", "json")
    assert export.returncode == 0 and record.returncode == 0, export.stderr + record.stderr
    assert "engine.dtype" in export.stdout and "engine.dtype" in record.stdout
    dump = "\n".join(sqlite3.connect(lab.root / "state" / "canaryd.db").iterdump())
    assert "engine.api_key" in dump  # the field is there, its value is not
    for where, text in {
        "database": dump,
        "state files": b"".join(p.read_bytes() for p in (lab.root / "state").iterdir()).decode("latin-1"),
        "logs": "\n".join(logs),
        "export": export.stdout + export.stderr,
        "record": record.stdout + record.stderr,
        "metrics": metrics,
    }.items():
        assert KEY not in text, where
