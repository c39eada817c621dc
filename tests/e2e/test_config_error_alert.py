"""A replayed reasoning model behind the ``openai`` kind → `canaryd run` → real Prometheus with the shipped
rules → real Alertmanager → a webhook receiver started here.

The replay server answers every chat request with OpenAI's recorded 400 for ``max_tokens`` on a reasoning
model, and the raw-prompt canary's ``/completions`` request with the recorded 404 for a chat model
(`tests/fixtures/refusals/`, each naming its source). The daemon must send each refused request once and
then hold it back (the replay server counts what reaches it), export ``canaryd_backend_config_errors``, and
``CanarydConfigError`` must reach the receiver with its runbook link; a SIGHUP sends them once more.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from canaryd.lab.vllm_process import free_port
from tests.harness.fixtures import load
from tests.harness.services import (
    WebhookReceiver,
    need,
    query,
    start_alertmanager,
    start_prometheus,
    wait_for,
)

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
RULES = REPO / "prometheus" / "canaryd-alerts.yml"

SUITE = """
[suite]
name = "e2e"
[[canary]]
id = "add"
messages = [{ role = "user", content = "What is 17 + 25? Answer with the number only." }]
[[canary]]
id = "capital"
messages = [{ role = "user", content = "Capital of France?" }]
[[canary]]
id = "raw"
prompt = "The three primary colors of light are"
"""

CONFIG = """
state_dir = "state"
suites = ["suite.toml"]
[daemon]
listen = "127.0.0.1:{metrics_port}"
[[schedules]]
name = "fast"
every = "1s"
[[backends]]
name = "o4"
kind = "openai"
base_url = "http://127.0.0.1:{replay_port}/v1"
model = "o4-mini"
"""


class Replay:
    """Answers each path with a recorded error body; counts the requests that reach it, per path."""

    def __init__(self) -> None:
        replies = {
            "/v1/chat/completions": load("refusals/openai-max-tokens"),
            "/v1/completions": load("refusals/openai-completions-chat-model"),
        }
        self.seen: Counter[str] = Counter()
        seen = self.seen

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                seen[self.path] += 1
                doc = replies[self.path]
                body = json.dumps(doc["body"]).encode()
                self.send_response(doc["status"])
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def setup(tmp_path):
    need("promtool")
    replay, receiver, services = Replay(), WebhookReceiver(), []
    metrics_port = free_port()
    (tmp_path / "suite.toml").write_text(SUITE)
    (tmp_path / "canaryd.toml").write_text(CONFIG.format(metrics_port=metrics_port, replay_port=replay.port))
    canaryd = None
    try:
        am, am_port = start_alertmanager(tmp_path, receiver.url)
        services.append(am)
        canaryd = subprocess.Popen(
            [sys.executable, "-m", "canaryd", "-c", str(tmp_path / "canaryd.toml"), "run"],
            stdout=(tmp_path / "canaryd.out").open("wb"),
            stderr=(tmp_path / "canaryd.log").open("wb"),
            cwd=tmp_path,
            env=os.environ.copy(),
        )
        prom, prom_url = start_prometheus(tmp_path, RULES, f"127.0.0.1:{metrics_port}", am_port)
        services.append(prom)
        yield replay, receiver, canaryd, prom_url, tmp_path
    finally:
        if canaryd is not None and canaryd.poll() is None:
            canaryd.terminate()
            canaryd.wait(30)
        for svc in services:
            svc.stop()
        receiver.stop()
        replay.server.shutdown()


def test_a_refused_request_is_sent_once_exported_and_alerted_as_a_config_error(setup):
    replay, receiver, canaryd, prom_url, root = setup
    wait_for(
        "the refusals exported",
        lambda: query(prom_url, 'canaryd_backend_config_errors{backend="o4"} == 3'),
        60,
    )
    wait_for(
        "three more passes", lambda: query(prom_url, 'canaryd_schedule_runs_total{schedule="fast"} >= 4'), 60
    )
    assert replay.seen == {"/v1/chat/completions": 2, "/v1/completions": 1}  # once per canary, never again

    fired = wait_for(
        "CanarydConfigError at the webhook",
        lambda: [a for _, a in receiver.firing() if a["labels"]["alertname"] == "CanarydConfigError"],
        150,
    )
    alert = fired[0]
    assert alert["labels"]["backend"] == "o4"
    assert alert["annotations"]["runbook_url"].endswith("/runbook#canarydconfigerror")
    assert "not an outage" in alert["annotations"]["summary"]
    assert replay.seen == {"/v1/chat/completions": 2, "/v1/completions": 1}
    log = (root / "canaryd.log").read_text() + (root / "canaryd.out").read_text()
    assert log.count("config_refused") == 2  # once per distinct refusal (max_tokens; /completions)

    canaryd.send_signal(signal.SIGHUP)  # a reload sends each held-back request once more
    wait_for("the re-sent requests", lambda: replay.seen["/v1/chat/completions"] == 4, 30)
    wait_for(
        "the refusals exported again",
        lambda: query(prom_url, 'canaryd_backend_config_errors{backend="o4"} == 3'),
        30,
    )
    assert replay.seen["/v1/completions"] == 2
