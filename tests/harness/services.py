"""Real Prometheus, Alertmanager and a webhook receiver for the end-to-end tests, on loopback ports.

The binaries come from Debian's packages (installed by ``test.sh``); a missing one fails the test.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx2

from canaryd.lab.vllm_process import free_port


def need(binary: str) -> str:
    path = shutil.which(binary)
    assert path, f"{binary} is not installed (Debian package; ./test.sh installs it)"
    return path


class TimedOut(AssertionError):
    """`wait_for`'s condition never held (a test failure, like any assertion)."""


def wait_for(what: str, check: Callable[[], object], timeout: float, every: float = 0.5) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            result = check()
        except (httpx2.HTTPError, OSError, ValueError, KeyError):
            result = None
        if result:
            return result
        time.sleep(every)
    raise TimedOut(f"timed out after {timeout:.0f} s waiting for {what}")


class Service:
    """A subprocess with its log in a file, stopped with SIGTERM then SIGKILL."""

    def __init__(self, argv: list[str], log: Path, cwd: Path | None = None) -> None:
        self.log = log
        self.proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=cwd)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


class WebhookReceiver:
    """Collects Alertmanager webhook notifications: (arrival time, alert) for every alert in a post."""

    def __init__(self) -> None:
        self.alerts: list[tuple[float, dict]] = []
        received = self.alerts

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                received.extend((time.time(), a) for a in body["alerts"])
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def firing(self) -> list[tuple[float, dict]]:
        return [(t, a) for t, a in self.alerts if a["status"] == "firing"]

    def stop(self) -> None:
        self.server.shutdown()


def start_alertmanager(root: Path, webhook_url: str) -> tuple[Service, int]:
    port = free_port()
    cfg = root / "alertmanager.yml"
    cfg.write_text(
        "route:\n  receiver: hook\n  group_by: [alertname, backend]\n"
        "  group_wait: 1s\n  group_interval: 1s\n  repeat_interval: 1h\n"
        "receivers:\n  - name: hook\n    webhook_configs:\n"
        f"      - url: {webhook_url}\n        send_resolved: true\n"
    )
    svc = Service(
        [
            need("prometheus-alertmanager"),
            f"--config.file={cfg}",
            f"--storage.path={root / 'am-data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
        ],
        root / "alertmanager.log",
    )
    wait_for("alertmanager", lambda: httpx2.get(f"http://127.0.0.1:{port}/-/ready").status_code == 200, 60)
    return svc, port


def start_prometheus(root: Path, rules: Path, target: str, alertmanager_port: int) -> tuple[Service, str]:
    port = free_port()
    cfg = root / "prometheus.yml"
    cfg.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"rule_files: [{rules}]\n"
        "alerting:\n  alertmanagers:\n    - static_configs:\n"
        f"        - targets: ['127.0.0.1:{alertmanager_port}']\n"
        "scrape_configs:\n  - job_name: canaryd\n    static_configs:\n"
        f"      - targets: ['{target}']\n"
    )
    svc = Service(
        [
            need("prometheus"),
            f"--config.file={cfg}",
            f"--storage.tsdb.path={root / 'prom-data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        root / "prometheus.log",
    )
    url = f"http://127.0.0.1:{port}"
    wait_for("prometheus", lambda: httpx2.get(f"{url}/-/ready").status_code == 200, 60)
    return svc, url


def query(prometheus_url: str, expr: str) -> list[dict]:
    r = httpx2.get(f"{prometheus_url}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert body["status"] == "success", f"{expr}: {body}"
    return body["data"]["result"]


def answered(prometheus_url: str, expr: str, timeout: float = 20) -> list[dict]:
    """The query's answer, asked again for a while if empty. On a loaded machine a scrape can pass its
    timeout (a second here); Prometheus then marks every series stale, and an instant query has no data
    until the next scrape succeeds, nor an alert until its rule next holds. The next good scrape answers."""
    try:
        return wait_for(expr, lambda: query(prometheus_url, expr), timeout)
    except TimedOut:  # a query Prometheus refused fails here, with its error
        return []


def scrapes(prometheus_url: str) -> str:
    """The last minute's scrapes, for a failure message: whether the target, not the query, failed."""

    def one(expr: str) -> str:
        return next((r["value"][1] for r in query(prometheus_url, expr)), "?")

    return (
        f"scrapes up {one('sum_over_time(up[1m])')} of {one('count_over_time(up[1m])')} in the last"
        f" minute, the slowest {one('max_over_time(scrape_duration_seconds[1m])')} s"
    )
