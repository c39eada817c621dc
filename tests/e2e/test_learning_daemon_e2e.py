"""Learning by default, end to end: a noisy OpenAI-compatible server → `canaryd run` (learning on, no
calibration step) → real Prometheus with the shipped alert rules.

The server answers like a GPU engine: the same tokens every time, every logprob with fresh noise of 0.01
nats per request. Without learning this pages on every pass (each answer moves from its baseline at
tolerance 0). With it, the daemon learns each canary's noise within its first passes: no drift verdict is
recorded and no drift alert reaches Prometheus, not even pending. Then every logprob moves by −0.3 nats,
and CanarydLogprobDrift fires. No vLLM: the server is here, and the learning settings are the smallest that
still fit a model over several passes, at a 2 s interval.
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import subprocess
import sys
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from canaryd.judge.verdicts import Verdict
from canaryd.lab.vllm_process import free_port
from tests.harness.alerts import drift_alerts
from tests.harness.services import need, query, start_prometheus, wait_for

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
RULES = REPO / "prometheus" / "canaryd-alerts.yml"
DRIFT = "|".join(v.value for v in Verdict if v.is_drift)
DRIFT_ALERTS = "|".join(drift_alerts(RULES))
NOISE_SD = 0.01
SHIFT = -0.3
CANARIES = ("add", "capital", "colors", "planet")

SUITE = """
[suite]
name = "e2e"
[defaults]
max_tokens = 8
[[canary]]
id = "add"
messages = [{ role = "user", content = "What is 17 + 25? Answer with the number only." }]
[[canary]]
id = "capital"
messages = [{ role = "user", content = "Capital of France?" }]
[[canary]]
id = "colors"
messages = [{ role = "user", content = "Name the three primary colors of light." }]
[[canary]]
id = "planet"
messages = [{ role = "user", content = "Which planet is the largest?" }]
"""

# Learning: 1 + 3 probes at first contact, then 1 + 3 a quiet pass: a window of 12 is full after 3 passes.
# Four canaries at K = 12 need all four out in one pass to alarm at the default arl (10,000).
CONFIG = """
state_dir = "state"
suites = ["suite.toml"]
[daemon]
listen = "127.0.0.1:{metrics_port}"
[compare]
learn_k = 12
learn_first = 3
learn_per_pass = 3
[[schedules]]
name = "fast"
every = "2s"
[[backends]]
name = "gpu"
kind = "openai"
base_url = "http://127.0.0.1:{port}/v1"
model = "m"
timeout_s = 10
"""


class NoisyEngine:
    """Answers each chat request with its prompt's fixed tokens; each logprob (chosen and top-k) is the
    token's own value plus fresh N(0, 0.01) noise, plus ``shift``."""

    def __init__(self) -> None:
        self.shift = 0.0
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.endswith("/models"):
                    self._reply(200, {"object": "list", "data": [{"id": "m", "object": "model"}]})
                else:
                    self._reply(404, {"error": {"message": "not found"}})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if not self.path.endswith("/chat/completions"):
                    self._reply(404, {"error": {"message": "not found"}})
                    return
                self._reply(200, engine.answer(body["messages"][-1]["content"]))

            def _reply(self, status: int, doc: dict) -> None:
                data = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, prompt: str) -> dict:
        rng = random.Random(zlib.crc32(prompt.encode()))  # the prompt's tokens and their true logprobs
        words = [f" w{rng.randrange(1000)}" for _ in range(4)]
        content = []
        for w in words:
            lps = [-rng.uniform(0.01, 0.8), -rng.uniform(1.5, 3.0), -rng.uniform(3.5, 6.0)]
            noisy = [min(0.0, lp + random.gauss(0.0, NOISE_SD) + self.shift) for lp in lps]
            tops = [(w, noisy[0]), (" x", noisy[1]), (" y", noisy[2])]
            content.append(
                {
                    "token": w,
                    "logprob": noisy[0],
                    "bytes": list(w.encode()),
                    "top_logprobs": [
                        {"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in tops
                    ],
                }
            )
        return {
            "id": "chatcmpl-noisy",
            "object": "chat.completion",
            "model": "m",
            "system_fingerprint": "fp_noisy",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(words)},
                    "finish_reason": "length",
                    "logprobs": {"content": content},
                }
            ],
            "usage": {"prompt_tokens": 12, "completion_tokens": len(words), "total_tokens": 12 + len(words)},
        }


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    need("promtool")
    root = tmp_path_factory.mktemp("learning")
    engine, metrics_port = NoisyEngine(), free_port()
    (root / "suite.toml").write_text(SUITE)
    (root / "canaryd.toml").write_text(CONFIG.format(metrics_port=metrics_port, port=engine.port))
    canaryd, prom = None, None
    try:
        canaryd = subprocess.Popen(
            [sys.executable, "-m", "canaryd", "-c", str(root / "canaryd.toml"), "run"],
            stdout=(root / "canaryd.out").open("wb"),
            stderr=(root / "canaryd.log").open("wb"),
            cwd=root,
            env=os.environ.copy(),
        )
        # no Alertmanager: the question is whether an alert reaches Prometheus (pending counts)
        prom, prom_url = start_prometheus(root, RULES, f"127.0.0.1:{metrics_port}", free_port())
        yield engine, prom_url, root
    finally:
        if canaryd is not None and canaryd.poll() is None:
            canaryd.terminate()
            canaryd.wait(30)
        if prom is not None:
            prom.stop()
        engine.server.shutdown()


def verdicts(root: Path) -> list[tuple[str, str]]:
    db = sqlite3.connect(root / "state" / "canaryd.db")
    return db.execute("select canary_id, verdict from observation order by id").fetchall()


def test_a_noisy_backend_learns_without_a_drift_alert_and_then_a_shift_fires_one(setup):
    engine, prom_url, root = setup
    done = 'canaryd_backend_learning_canaries{backend="gpu"} == 0'  # 4 from the first pass until fitted
    wait_for("learning done", lambda: query(prom_url, done), 120)
    runs = float(query(prom_url, 'canaryd_schedule_runs_total{schedule="fast"}')[0]["value"][1])
    wait_for(
        "five passes judged on the learned models",
        lambda: query(prom_url, f'canaryd_schedule_runs_total{{schedule="fast"}} >= {runs + 5}'),
        60,
    )
    seen = verdicts(root)
    assert {c for c, _ in seen} == set(CANARIES)
    assert not {v for _, v in seen} & set(DRIFT.split("|")), seen
    assert "learning" in {v for _, v in seen} and {v for _, v in seen[-4:]} <= {"within-noise", "identical"}
    # nothing drifted in any scrape, and no drift alert was ever pending or firing
    assert not query(prom_url, f'max_over_time(canaryd_canary_verdict{{verdict=~"{DRIFT}"}}[10m]) == 1')
    assert not query(prom_url, f'max_over_time(ALERTS{{alertname=~"{DRIFT_ALERTS}"}}[10m])')

    engine.shift = SHIFT  # every logprob moves by -0.3 nats
    wait_for(
        "CanarydLogprobDrift firing",
        lambda: query(
            prom_url, 'ALERTS{alertname="CanarydLogprobDrift", alertstate="firing", backend="gpu"}'
        ),
        150,
        every=1,
    )
    assert query(prom_url, 'canaryd_backend_drift_alarm{backend="gpu"} == 1')
    log = (root / "canaryd.log").read_text()
    assert "Traceback" not in log
