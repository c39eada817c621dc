"""Hostile inputs and environments that only a real ``canaryd`` process shows (issue 15): signals during
start-up, file modes under the caller's umask, a metrics port in use, unusable state directories and
database URLs, 300 idle connections to the metrics server, and a daemon that stays responsive while an
answer check backtracks. Each ends in bounded time with one line and the documented exit code. The fast,
in-process cases are in tests/unit/test_hostile_inputs.py.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx2
import pytest

from canaryd.config import load_config
from canaryd.daemon.service import Daemon
from tests.harness.hostile_lab import (
    ENV,
    SLOW,
    SLOW_SUITE,
    canaryd,
    mode,
    one_error_line,
    scrape,
    write_config,
)
from tests.harness.scripted_lab import PLAIN, scripted


def test_check_with_a_backtracking_regex_is_an_error_in_seconds(tmp_path):
    (tmp_path / "slow.toml").write_text(SLOW_SUITE)
    cfg = write_config(tmp_path, ["slow.toml"])
    t = time.monotonic()
    p = canaryd(cfg, "check", "--json")
    took = time.monotonic() - t
    assert p.returncode == 3, p.stderr
    # The check's bound is 1 s; uncut, 2^40 backtracking steps take hours. The rest is two interpreters
    # starting on a loaded 2-core machine (9 s was seen with the e2e suite beside other work).
    assert took < 30, took
    (result,) = json.loads(p.stdout)["results"]
    assert result["verdict"] == "error" and result["error_kind"] == "check_timeout"
    assert "'slow'" in result["error"] and SLOW in result["error"]

    v = canaryd(cfg, "validate")
    assert v.returncode == 0, v.stderr
    (warning,) = [line for line in v.stderr.splitlines() if line.startswith("canaryd: warning:")]
    assert "slow.toml" in warning and SLOW in warning and "backtrack" in warning


def test_a_daemon_stays_responsive_while_a_check_times_out(tmp_path):
    (tmp_path / "slow.toml").write_text(SLOW_SUITE)
    cfg = write_config(tmp_path, ["slow.toml"], tail='[[schedules]]\nname = "fast"\nevery = "1s"\n')
    d = Daemon(cfg, load_config(cfg))
    d.start()
    try:
        url = f"http://127.0.0.1:{d.config.daemon.host_port[1]}/metrics"
        worst, deadline = 0.0, time.monotonic() + 4
        while time.monotonic() < deadline:  # ~3 passes, each with a 1 s check
            t = time.monotonic()
            assert httpx2.get(url, timeout=5).status_code == 200
            worst = max(worst, time.monotonic() - t)
            time.sleep(0.05)
        failures = d.metrics.registry.get_sample_value(
            "canaryd_backend_probe_failures_total", {"backend": "fake", "reason": "check_timeout"}
        )
    finally:
        d.stop()
    assert worst < 1.0, worst
    assert failures and failures >= 1


def test_files_canaryd_creates_are_private_under_umask_022(tmp_path):
    (tmp_path / "plain.toml").write_text(PLAIN)
    cfg = write_config(tmp_path, ["plain.toml"], backends=scripted())
    state = tmp_path / "state"
    p = canaryd(cfg, "check", "--json", umask=0o022)
    assert p.returncode == 0, p.stderr
    run_id = json.loads(p.stdout)["results"][0]["run_id"]
    assert mode(state) == 0o700 and mode(state / "canaryd.db") == 0o600
    for args, out in [
        (["pin", "--out"], tmp_path / "pin.json"),
        (["export", "--run", str(run_id), "--out"], tmp_path / "export.jsonl"),
        (["record", "--run", str(run_id), "--out"], tmp_path / "record.md"),
    ]:
        p = canaryd(cfg, *args, str(out), umask=0o022)
        assert p.returncode == 0, p.stderr
        assert mode(out) == 0o600, (args, oct(mode(out)))

    # the daemon holds the database open: its WAL and shared-memory files exist meanwhile
    daemon = subprocess.Popen(
        [sys.executable, "-m", "canaryd", "-c", str(cfg), "run"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        umask=0o022,
    )
    try:
        deadline = time.monotonic() + 30
        while not ((state / "canaryd.db-wal").exists() and (state / "canaryd.db-shm").exists()):
            assert daemon.poll() is None and time.monotonic() < deadline, daemon.stderr.read()  # type: ignore[union-attr]
            time.sleep(0.1)
        modes = {f: mode(state / f) for f in ("canaryd.db", "canaryd.db-wal", "canaryd.db-shm")}
    finally:
        daemon.send_signal(signal.SIGTERM)
        _, err = daemon.communicate(timeout=60)
    assert modes == dict.fromkeys(modes, 0o600), modes
    assert daemon.returncode == 0, err


def test_init_writes_a_config_the_service_can_read(tmp_path):
    p = canaryd(None, "init", str(tmp_path / "etc" / "canaryd.toml"))
    assert p.returncode == 0, p.stderr
    assert mode(tmp_path / "etc" / "canaryd.toml") == 0o644
    assert mode(tmp_path / "etc" / "canaries" / "default.toml") == 0o644
    assert mode(tmp_path / "etc") == 0o755


def test_a_metrics_port_in_use_exits_2_naming_daemon_listen(tmp_path):
    (tmp_path / "plain.toml").write_text(PLAIN)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = write_config(tmp_path, ["plain.toml"], backends=scripted(), port=port)
        p = canaryd(cfg, "run")
    assert p.returncode == 2, p.stderr
    line = one_error_line(p)
    assert f"daemon.listen 127.0.0.1:{port}: address already in use" in line and str(cfg) in line


@pytest.mark.parametrize("command", ["check", "run", "db upgrade"])  # readers: tests/unit/test_cli.py
def test_a_state_dir_that_cannot_be_created_exits_2_naming_state_dir(tmp_path, command):
    (tmp_path / "plain.toml").write_text(PLAIN)
    (tmp_path / "file").write_text("not a directory")
    cfg = write_config(tmp_path, ["plain.toml"], backends=scripted())
    cfg.write_text(cfg.read_text().replace('state_dir = "state"', 'state_dir = "file/state"'))
    p = canaryd(cfg, *command.split())
    assert p.returncode == 2, p.stderr
    line = one_error_line(p)
    assert f"state_dir {tmp_path / 'file' / 'state'}: cannot create: Not a directory" in line


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("nosuchdb://x/y", "unusable"),
        ("not a url", "unusable"),
        ("sqlite:///{tmp}/file/x.db", "cannot create"),
    ],
)
def test_a_storage_url_that_cannot_be_used_exits_2_naming_storage_url(tmp_path, url, why):
    (tmp_path / "plain.toml").write_text(PLAIN)
    (tmp_path / "file").write_text("not a directory")
    url = url.format(tmp=tmp_path)
    cfg = write_config(
        tmp_path, ["plain.toml"], backends=scripted(), tail=f"[storage]\nurl = {json.dumps(url)}\n"
    )
    p = canaryd(cfg, "check")
    assert p.returncode == 2, p.stderr
    line = one_error_line(p)
    assert f"storage.url {url}: unusable" in line and why in line


def test_300_idle_connections_cost_no_threads_and_scrapes_still_succeed(tmp_path):
    (tmp_path / "plain.toml").write_text(PLAIN)
    cfg = write_config(tmp_path, ["plain.toml"], backends=scripted())
    d = Daemon(cfg, load_config(cfg))
    d.start()
    port = d.config.daemon.host_port[1]
    idle: list[socket.socket] = []
    try:
        assert scrape(port)[0] == 200
        time.sleep(0.2)
        before = threading.active_count()
        for _ in range(300):
            idle.append(socket.create_connection(("127.0.0.1", port)))
        time.sleep(0.5)
        during = threading.active_count()
        status, took = scrape(port)
        index = httpx2.get(f"http://127.0.0.1:{port}/", timeout=5)
        crowd: list[int] = []  # 50 concurrent scrapers, 4 scrapes each: served in turn, none refused
        scrapers = [
            threading.Thread(target=lambda: crowd.extend(scrape(port)[0] for _ in range(4)))
            for _ in range(50)
        ]
        for scraper in scrapers:
            scraper.start()
        for scraper in scrapers:
            scraper.join()
    finally:
        for s in idle:
            s.close()
        d.stop()
    print(f"threads: {before} before, {during} with 300 idle connections; scrape {took * 1000:.0f} ms")
    assert during <= before + 2, (before, during)
    assert status == 200 and took < 1.0
    assert index.status_code == 200 and "/metrics" in index.text
    assert crowd == [200] * 200


@pytest.mark.parametrize("delay", [0.2, 0.5, 1.0])
def test_sigterm_during_start_up_exits_0(tmp_path, delay):
    (tmp_path / "plain.toml").write_text(PLAIN)
    cfg = write_config(tmp_path, ["plain.toml"], backends=scripted())
    daemon = subprocess.Popen(
        [sys.executable, "-m", "canaryd", "-c", str(cfg), "run"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    time.sleep(delay)
    daemon.send_signal(signal.SIGTERM)
    _, err = daemon.communicate(timeout=60)
    assert daemon.returncode == 0, err
    assert "Traceback" not in err
