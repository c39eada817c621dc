"""The Grafana dashboard's panel queries through promtool (Debian's ``prometheus`` package): each one, its
variables substituted, parses as PromQL; and through a real Prometheus scraping a real metrics server
(the exposition canaryd caches per pass): each returns data, and the shipped alert rules evaluate on those
series. Without promtool or Prometheus this fails, as CI must.

The static checks of the dashboard are in tests/unit/test_dashboard.py; the same live check against a
daemon probing a real vLLM is in tests/e2e/test_daemon_e2e.py.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx2
import pytest

from canaryd.daemon.httpserver import MetricsServer
from canaryd.daemon.metrics import Metrics
from canaryd.judge.reference import decide
from canaryd.lab.vllm_process import free_port
from canaryd.probe.reference import Check, Cycle
from tests.harness.services import answered, need, query, scrapes, start_prometheus, wait_for
from tests.unit.test_metrics import run

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
DASHBOARD = REPO / "grafana" / "canaryd-dashboard.json"
RULES = REPO / "prometheus" / "canaryd-alerts.yml"
_spec = importlib.util.spec_from_file_location("build_dashboard", REPO / "grafana" / "build_dashboard.py")
bd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bd)


@pytest.fixture(scope="module")
def dash() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_queries_parse_with_promtool(dash, tmp_path):
    """Each substituted query, wrapped in a throw-away recording rule, passes ``promtool check rules``."""
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query{i}", "expr": q}
                    for i, (_, q) in enumerate(bd.panel_queries(dash))
                ],
            }
        ]
    }
    path = tmp_path / "rules.yml"
    path.write_text(json.dumps(rules))  # JSON is YAML
    r = subprocess.run([need("promtool"), "check", "rules", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


# -- a real Prometheus scraping the cached exposition ----------------------------------------------------


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    """A real Prometheus (OpenMetrics, gzip: as it always scrapes) with the shipped alert rules, scraping a
    real MetricsServer whose Metrics get a synthetic pass every half second (the canaries drift, the stack
    changes on every pass, the reference parts from one answer), each published once, as the daemon does."""
    root = tmp_path_factory.mktemp("prometheus")
    metrics = Metrics()
    ids = ("add", "capital", "colors")
    metrics.set_intervals([("local", c, 1.0) for c in ids])
    metrics.set_lease("local", True)  # as the daemon says of every backend it probes (always, on SQLite)
    server = MetricsServer(("127.0.0.1", 0), metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    stop = threading.Event()

    def feed() -> None:
        n = 0
        while not stop.wait(0.5):
            n += 1
            metrics.schedule_runs.labels("fast").inc()
            metrics.schedule_overruns.labels("fast")  # 0 from the start, as the daemon installs it
            checks = {"add": Check(parting=0.4, noise=0.0)}
            cycle = Cycle("reference", checks, {"add": 0.0}, decide({"add": 0.0}, 0.01))
            passed = run(stack_fp=f"fp-{n % 2}", lp=-0.6, backend="local", canaries=ids)
            metrics.record(replace(passed, reference=cycle))
            metrics.publish()
            metrics.schedule_last.labels("fast").set(time.time())

    threading.Thread(target=feed, daemon=True).start()
    prom, url = start_prometheus(root, RULES, f"127.0.0.1:{server.server_address[1]}", free_port())
    try:
        wait_for("three scrapes", lambda: query(url, "count_over_time(up[1m]) >= 3 and up == 1"), 60)
        yield url, metrics, server.server_address[1]
    finally:
        stop.set()
        prom.stop()
        server.shutdown()


def test_every_panel_query_returns_data_from_the_cached_exposition(dash, prometheus):
    url, _, _ = prometheus
    queries = bd.panel_queries(
        dash, {"job": "canaryd", "backend": "local", "__rate_interval": "1m", "__range": "5m"}
    )
    wait_for(
        "a stack change in a rate window",
        lambda: query(url, "increase(canaryd_backend_stack_changes_total[1m]) > 0"),
        30,
    )
    empty = [(title, q) for title, q in queries if not answered(url, q)]
    assert not empty, f"panels without data: {empty}; {scrapes(url)}"


def test_the_alert_rules_evaluate_on_the_real_series(prometheus):
    url, _, _ = prometheus
    groups = wait_for(
        "rules evaluated",
        lambda: [
            g
            for g in httpx2.get(f"{url}/api/v1/rules", timeout=10).json()["data"]["groups"]
            if all(r.get("lastEvaluation", "").startswith("20") for r in g["rules"])
        ],
        30,
    )
    bad = [(r["name"], r.get("lastError")) for g in groups for r in g["rules"] if r["health"] != "ok"]
    assert not bad, bad
    # the drifting canary is seen as drift on the real series (pending: its `for:` is a minute)
    alerts = answered(url, 'ALERTS{alertname="CanarydLogprobDrift"}')
    assert alerts, f"no drift alert; {scrapes(url)}"
    assert alerts[0]["metric"]["instance"] and alerts[0]["metric"]["backend"] == "local"


def test_the_served_exposition_passes_promtool_lint(prometheus):
    """The text format (promtool lints only that; the OpenMetrics body is what Prometheus scraped above)."""
    _, _, port = prometheus
    body = httpx2.get(f"http://127.0.0.1:{port}/metrics", timeout=10).content
    lint = subprocess.run([need("promtool"), "check", "metrics"], input=body, capture_output=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
