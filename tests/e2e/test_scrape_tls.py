"""A real Prometheus scrapes a real `canaryd run` over TLS with a client certificate and basic auth (an
exporter-toolkit web config, ``[daemon] web_config``), beside four jobs that must fail, each at its own
layer: a wrong password (401), plain HTTP to the TLS port, a CA the scraper does not trust, and no client
certificate. The daemon logs each kind of refusal once, however often Prometheus retries.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import bcrypt
import httpx2

from canaryd.lab.vllm_process import free_port
from tests.harness.services import Service, need, query, wait_for
from tests.harness.suites import PLAIN
from tests.harness.tls import CA

PASSWORD = "scrape-over-tls"
CONFIG = """
state_dir = "state"
suites = ["suite.toml"]
[daemon]
listen = "127.0.0.1:{port}"
web_config = "web.yml"
[[schedules]]
name = "fast"
every = "1s"
[[backends]]
name = "fake"
kind = "scripted"
"""


def job(name: str, port: int, scheme: str, tls: str, password: str | None) -> str:
    auth = "" if password is None else f"    basic_auth: {{username: prometheus, password: '{password}'}}\n"
    return (
        f"  - job_name: {name}\n    scheme: {scheme}\n{auth}"
        + (f"    tls_config: {{{tls}}}\n" if tls else "")
        + f"    static_configs: [{{targets: ['127.0.0.1:{port}']}}]\n"
    )


def test_prometheus_scrapes_over_tls_with_basic_auth_and_every_wrong_door_fails(tmp_path: Path) -> None:
    ca, other = CA(tmp_path, "main"), CA(tmp_path, "other")
    server, scraper = ca.issue("server", server=True), ca.issue("prometheus", server=False)
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=10)).decode()
    (tmp_path / "web.yml").write_text(
        f"tls_server_config:\n  cert_file: {server.cert.name}\n  key_file: {server.key.name}\n"
        f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {ca.cert.name}\n"
        f"basic_auth_users:\n  prometheus: '{hashed}'\n"
    )
    port = free_port()
    (tmp_path / "suite.toml").write_text(PLAIN)
    (tmp_path / "canaryd.toml").write_text(CONFIG.format(port=port))
    trusted = f"ca_file: {ca.cert}, cert_file: {scraper.cert}, key_file: {scraper.key}"
    jobs = {
        "good": job("good", port, "https", trusted, PASSWORD),
        "wrong_password": job("wrong_password", port, "https", trusted, PASSWORD + "x"),
        "plain_http": job("plain_http", port, "http", "", PASSWORD),
        "untrusted_ca": job(
            "untrusted_ca",
            port,
            "https",
            f"ca_file: {other.cert}, cert_file: {scraper.cert}, key_file: {scraper.key}",
            PASSWORD,
        ),
        "no_client_cert": job("no_client_cert", port, "https", f"ca_file: {ca.cert}", PASSWORD),
    }
    prom_port = free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n" + "".join(jobs.values())
    )
    log = (tmp_path / "daemon.log").open("w")
    daemon = subprocess.Popen(
        [sys.executable, "-m", "canaryd", "-c", str(tmp_path / "canaryd.toml"), "run"],
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    prom = Service(
        [
            need("prometheus"),
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'prom-data'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
        ],
        tmp_path / "prometheus.log",
    )
    url = f"http://127.0.0.1:{prom_port}"
    try:
        wait_for("prometheus", lambda: httpx2.get(f"{url}/-/ready").status_code == 200, 60)

        def scraped() -> dict[str, dict]:
            targets = httpx2.get(f"{url}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
            seen = {t["labels"]["job"]: t for t in targets if t["health"] != "unknown"}
            return seen if len(seen) == len(jobs) and query(url, 'canaryd_build_info{job="good"}') else {}

        targets = wait_for("every job scraped at least once", scraped, 90)
        for _ in range(3):  # Prometheus retries every second: the refusals repeat, their log lines do not
            wait_for("another round of scrapes", lambda: scraped() or None, 10)
        targets = scraped()
        assert targets["good"]["health"] == "up", targets["good"]["lastError"]
        assert [r["value"][1] for r in query(url, 'up{job="good"}')] == ["1"]
        errors = {name: t["lastError"] for name, t in targets.items() if name != "good"}
        assert all(targets[name]["health"] == "down" for name in errors), errors
        assert "401" in errors["wrong_password"], errors
        assert "certificate" in errors["untrusted_ca"] and "unknown authority" in errors["untrusted_ca"]
        assert "401" not in errors["plain_http"] and "401" not in errors["no_client_cert"], errors
    finally:
        prom.stop()
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=30)
        log.close()
    lines = [json.loads(x) for x in (tmp_path / "daemon.log").read_text().splitlines() if x.startswith("{")]
    refused = [x["reason"] for x in lines if x.get("event") == "metrics request refused"]
    assert sorted(refused) == sorted(
        [
            "wrong password",
            "plain HTTP to the TLS port",
            "client does not trust the server certificate",
            "client sent no certificate",
        ]
    ), refused
