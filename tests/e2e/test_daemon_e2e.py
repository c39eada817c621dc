"""The daemon end to end: real vLLM → `canaryd run` → real Prometheus with the shipped rules → real
Alertmanager → a webhook receiver started here.

An unchanged restart of the vLLM server must raise no alert; a restart with another dtype must deliver a
drift / stack-change alert. Along the way: `promtool check metrics` on the live exposition, every
dashboard panel query returns data, sd_notify READY/WATCHDOG arrive, SIGTERM exits cleanly.
"""

import importlib.util
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2
import pytest

from canaryd.lab.vllm_process import VLLMServer, free_port
from tests.harness.alerts import drift_alerts
from tests.harness.services import (
    Service,
    WebhookReceiver,
    answered,
    need,
    query,
    scrapes,
    start_alertmanager,
    start_prometheus,
    wait_for,
)

pytestmark = pytest.mark.vllm
REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
RULES = REPO / "prometheus" / "canaryd-alerts.yml"
DRIFT_ALERTS = set(drift_alerts(RULES))
INTERVAL_S = 2
KEY = "sk-canaryd-daemon-8e3b5d1f"  # required by the server; must never show in /metrics or logs

SUITE = """
[suite]
name = "e2e"
[defaults]
max_tokens = 8
[[canary]]
id = "add"
messages = [{ role = "user", content = "What is 17 + 25? Answer with the number only." }]
expect = { number = 42 }
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
fingerprint_window = "10m"
[[schedules]]
name = "fast"
every = "{interval}s"
[[backends]]
name = "local"
kind = "vllm"
base_url = "http://127.0.0.1:{vllm_port}/v1"
model = "tiny"
timeout_s = 20
api_key_env = "CANARYD_DAEMON_KEY"
"""


class Stack:
    def __init__(self, root: Path, model: Path) -> None:
        self.root, self.model = root, model
        self.vllm_port, self.metrics_port = free_port(), free_port()
        (root / "suite.toml").write_text(SUITE)
        (root / "canaryd.toml").write_text(
            CONFIG.format(metrics_port=self.metrics_port, vllm_port=self.vllm_port, interval=INTERVAL_S)
        )
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.notify_path = root / "notify.sock"
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(self.notify_path))
        self.notes: list[str] = []
        threading.Thread(target=self._drain_notify, daemon=True).start()  # as systemd does: keep reading
        self.vllm: VLLMServer | None = None
        self.services: list[Service] = []

    def serve(self, dtype: str) -> float:
        """(Re)start vLLM on the same port; returns the time it became healthy."""
        if self.vllm is not None:
            self.vllm.stop()
        self.vllm = VLLMServer(
            self.model,
            port=self.vllm_port,
            dtype=dtype,
            api_key=KEY,
            extra_args=["--enforce-eager"],
            log_path=self.root / f"vllm-{dtype}.log",
        ).start()
        return time.time()

    def start_canaryd(self) -> None:
        env = {
            **os.environ,
            "NOTIFY_SOCKET": str(self.notify_path),
            "WATCHDOG_USEC": "2000000",
            "CANARYD_DAEMON_KEY": KEY,
        }
        self.canaryd = subprocess.Popen(
            [sys.executable, "-m", "canaryd", "-c", str(self.root / "canaryd.toml"), "run"],
            stdout=(self.root / "canaryd.out").open("wb"),
            stderr=(self.root / "canaryd.log").open("wb"),
            env=env,
            cwd=self.root,
        )

    def calibrate(self) -> None:
        """Baselines, then the noise model the evidence metrics and CanarydDriftEvidence need."""
        for args in (("probe",), ("baseline", "calibrate", "-k", "4", "--batch-sizes", "1,2")):
            p = subprocess.run(
                [sys.executable, "-m", "canaryd", "-c", str(self.root / "canaryd.toml"), *args],
                capture_output=True,
                text=True,
                env={**os.environ, "CANARYD_DAEMON_KEY": KEY},
                timeout=300,
            )
            assert p.returncode == 0, p.stdout + p.stderr

    def _drain_notify(self) -> None:
        while True:
            self.notes.append(self.notify.recv(4096).decode())

    def metric(self, expr: str) -> list[dict]:
        return query(self.prom_url, expr)

    def moved(self) -> list[tuple]:
        """Every probe that answered unlike its baseline, with why: what a failed no-alert check shows."""
        db = sqlite3.connect(self.root / "state" / "canaryd.db")
        return db.execute(
            "select started_at, canary_id, verdict, comparison from observation "
            "where verdict not in ('baseline', 'identical', 'error') order by id"
        ).fetchall()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    need("promtool")
    s = Stack(tmp_path_factory.mktemp("daemon"), tiny_model)
    s.receiver = WebhookReceiver()
    try:
        am, am_port = start_alertmanager(s.root, s.receiver.url)
        s.services.append(am)
        s.serve("float32")
        s.calibrate()
        s.start_canaryd()
        prom, s.prom_url = start_prometheus(s.root, RULES, f"127.0.0.1:{s.metrics_port}", am_port)
        s.services.append(prom)
        yield s
    finally:
        if getattr(s, "canaryd", None) and s.canaryd.poll() is None:
            s.canaryd.kill()
        if s.vllm is not None:
            s.vllm.stop()
        for svc in s.services:
            svc.stop()
        s.receiver.stop()


def test_daemon_probes_exports_lint_clean_metrics_and_notifies_systemd(stack):
    wait_for(
        "two passes scraped", lambda: stack.metric('canaryd_schedule_runs_total{schedule="fast"} >= 2'), 120
    )
    wait_for(
        "identical verdicts",
        lambda: len(stack.metric('canaryd_canary_verdict{verdict="identical"} == 1')) == 3,
        60,
    )
    exposition = httpx2.get(stack.metrics_url).text
    lint = subprocess.run(
        [need("promtool"), "check", "metrics"], input=exposition, capture_output=True, text=True
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
    assert 'canaryd_backend_stack_info{backend="local",engine_version="0.32.0"' in exposition.replace(
        'kind="vllm",', ""
    )
    assert "canaryd_build_info{" in exposition and KEY not in exposition

    t0 = time.perf_counter()
    with httpx2.Client() as client:
        for _ in range(20):
            client.get(stack.metrics_url)
    print(
        f"\nFIGURE /metrics scrape latency: {(time.perf_counter() - t0) / 20 * 1000:.1f} ms "
        f"({len(exposition)} bytes)"
    )

    notes = "\n".join(stack.notes)
    assert "READY=1" in notes and "WATCHDOG=1" in notes


def test_unchanged_restart_raises_no_alert(stack):
    ready = stack.serve("float32")
    wait_for(
        "a successful pass after the restart",
        lambda: stack.metric(
            "min(canaryd_canary_probe_success) == 1 and "
            f"min(canaryd_canary_last_probe_timestamp_seconds) > {ready}"
        ),
        120,
    )
    time.sleep(65)  # longer than the drift alerts' `for:`: a false verdict would have fired by now
    # a scrape that a loaded machine timed out leaves no series until the next: asked again for a while
    identical = answered(stack.prom_url, 'canaryd_canary_verdict{verdict="identical"} == 1')
    assert identical, (stack.metric("canaryd_canary_verdict == 1"), scrapes(stack.prom_url), stack.moved())
    assert not stack.metric('ALERTS{alertname=~"' + "|".join(DRIFT_ALERTS) + '"}'), stack.moved()
    assert not [a for _, a in stack.receiver.firing() if a["labels"]["alertname"] in DRIFT_ALERTS]


def test_dtype_change_delivers_an_alert(stack):
    ready = stack.serve("bfloat16")
    arrived = wait_for(
        "a drift alert at the webhook",
        lambda: [
            (t, a)
            for t, a in stack.receiver.firing()
            if t > ready and a["labels"]["alertname"] in DRIFT_ALERTS  # this change's, not an earlier one
        ],
        300,
        every=1,
    )
    first_t, first = min(arrived, key=lambda x: x[0])
    assert first["labels"]["backend"] == "local"
    assert first["annotations"]["runbook_url"].endswith("#" + first["labels"]["alertname"].lower())
    print(
        f"\nFIGURE stack change → alert at receiver: {first_t - ready:.1f} s "
        f"({first['labels']['alertname']}; probe every {INTERVAL_S} s, scrape/eval 1 s, group_wait 1 s)"
    )
    assert stack.metric('canaryd_backend_stack_changes_total{backend="local"} >= 1')
    assert stack.metric('canaryd_canary_verdict{verdict=~"logprob-drift|answer-drift"} == 1')
    assert stack.metric('canaryd_backend_drift_alarm{backend="local"} == 1')
    assert stack.metric('canaryd_backend_drift_evidence{backend="local"} > 0')


def test_every_dashboard_panel_query_returns_data(stack):
    spec = importlib.util.spec_from_file_location("build_dashboard", REPO / "grafana" / "build_dashboard.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    import json

    dashboard = json.loads((REPO / "grafana" / "canaryd-dashboard.json").read_text())
    # wide windows: the stack change happened a minute or more ago
    queries = mod.panel_queries(
        dashboard, {"job": "canaryd", "backend": "local", "__rate_interval": "10m", "__range": "15m"}
    )
    assert len(queries) >= 8
    # a panel of a feature this daemon's config does not use has no series here; test_dashboard.py feeds it
    unused = {"Reference divergence (nats)"}  # no backend here names a reference
    assert unused <= {title for title, _ in queries}
    empty = [(t, expr) for t, expr in queries if t not in unused and not answered(stack.prom_url, expr)]
    assert not empty, f"panels without data: {empty}; {scrapes(stack.prom_url)}"


def test_sigterm_exits_cleanly_with_an_intact_database(stack):
    stack.canaryd.send_signal(signal.SIGTERM)
    assert stack.canaryd.wait(60) == 0
    assert "STOPPING=1" in "\n".join(stack.notes)
    db = sqlite3.connect(stack.root / "state" / "canaryd.db")
    assert db.execute("pragma integrity_check").fetchone()[0] == "ok"
    assert db.execute("select count(*) from observation where verdict = 'identical'").fetchone()[0] > 0
    log = (stack.root / "canaryd.log").read_text()
    assert "Traceback" not in log and KEY not in log
