"""A server that drips its answer can neither freeze ``canaryd check`` nor hold the daemon's stop: the CLI
and the daemon as processes (`canaryd check`, `canaryd run` + SIGTERM) against the loopback server of
`tests.harness.loopback`, which sends one byte a second for as long as the client listens.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness.loopback import Loopback
from tests.harness.scripted_lab import free_port

SUITE = """
[suite]
name = "s"
[defaults]
max_tokens = 4
[[canary]]
id = "add"
messages = [{ role = "user", content = "What is 17 + 25?" }]
[[canary]]
id = "colors"
messages = [{ role = "user", content = "Name a primary colour." }]
"""


@pytest.fixture(scope="module")
def server():
    with Loopback(drip_s=1.0) as s:
        yield s


def write(root: Path, url: str, timeout_s: float, retries: int, concurrency: int, tail: str = "") -> Path:
    (root / "suite.toml").write_text(SUITE)
    path = root / "canaryd.toml"
    path.write_text(
        f'state_dir = "state"\nsuites = ["suite.toml"]\n'
        f'[[backends]]\nname = "drip"\nkind = "openai"\nbase_url = "{url}"\nmodel = "m"\n'
        f'timeout_s = {timeout_s}\nretries = {retries}\nretry_backoff = "200ms"\n'
        f"concurrency = {concurrency}\n{tail}"
    )
    return path


def canaryd(path: Path, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "canaryd", "-c", str(path), *args],
        env={**os.environ, "NO_COLOR": "1"},
        **kw,
    )


def test_check_against_a_dripping_server_ends_at_the_deadline(tmp_path, server):
    path = write(tmp_path, server.base("drip-body"), timeout_s=2, retries=0, concurrency=2)
    sent = len(server.requests)
    t0 = time.monotonic()
    p = canaryd(path, "check", "--json", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=60)
    ended = time.monotonic()
    assert p.returncode == 3, err
    results = json.loads(out)["results"]
    assert {r["error_kind"] for r in results} == {"timeout"} and len(results) == 2
    assert all(r["error"].startswith("deadline of 2s passed after ") for r in results)
    # both canaries at once: 2 s from the first request to the exit (storing, printing, exiting: < 1 s);
    # before it, the interpreter's start and the store's creation (1-3 s, more on a busy machine)
    probes = server.requests[sent:]
    assert len(probes) == 2 and ended - probes[0].at < 2 + 1.5, f"{ended - probes[0].at:.1f}s"
    assert ended - t0 < 2 + 10, f"check took {ended - t0:.1f}s"


def test_sigterm_stops_the_daemon_within_timeout_s_whatever_the_backend_does(tmp_path, server):
    timeout_s = 3
    tail = (
        f'[daemon]\nlisten = "127.0.0.1:{free_port()}"\ninstance = "unit"\n'
        '[[schedules]]\nname = "fast"\nevery = "1s"\n'
    )
    path = write(tmp_path, server.base("drip-body"), timeout_s=timeout_s, retries=2, concurrency=1, tail=tail)
    sent = len(server.requests)
    with open(tmp_path / "daemon.log", "w") as log:
        p = canaryd(path, "run", stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 30
            while len(server.requests) <= sent:  # the first probe is on the wire (and dripping)
                assert p.poll() is None and time.monotonic() < deadline, (tmp_path / "daemon.log").read_text()
                time.sleep(0.05)
            time.sleep(1.5)  # mid-attempt: 1.5 s of the 3 s deadline left
            t0 = time.monotonic()
            p.send_signal(signal.SIGTERM)
            code = p.wait(timeout=timeout_s + 30)
            took = time.monotonic() - t0
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    output = (tmp_path / "daemon.log").read_text()
    assert code == 0, output
    assert took < timeout_s + 5, f"stop took {took:.1f}s"
    assert "stopped" in output and "Traceback" not in output

    db = sqlite3.connect(tmp_path / "state" / "canaryd.db")
    try:
        assert db.execute("pragma integrity_check").fetchone()[0] == "ok"
        rows = db.execute("select canary_id, error_kind, error from observation order by id").fetchall()
    finally:
        db.close()
    # the attempt in flight ended at its deadline and was not retried; the canary after it was not sent
    assert [r[:2] for r in rows] == [("add", "timeout"), ("colors", "stopped")], rows
    assert rows[0][2].endswith("(not retried: canaryd is stopping)")
    assert rows[1][2] == "not sent: canaryd is stopping"
    probes = [r for r in server.requests[sent:] if r.path.endswith("/chat/completions")]
    assert probes and all(r.at < t0 for r in probes)  # no attempt started after the SIGTERM


def test_a_canary_left_unsent_by_the_stop_leaves_the_series_alone():
    """Stored (the pass was cut short: history says so), but no failure of the backend's in the metrics."""
    from canaryd.backends import BackendUnavailable
    from canaryd.daemon.metrics import Metrics
    from canaryd.judge.compare import Comparison, Verdict
    from canaryd.observation import ErrorKind, Observation, utcnow
    from canaryd.probe.run import BackendRun, Result

    obs = Observation("b", "add", "s", utcnow(), {}, "")
    obs.error_kind, obs.error = ErrorKind.STOPPED, "not sent: canaryd is stopping"
    m = Metrics()
    m.record(BackendRun("b", "openai", 1, [Result(1, 1, obs, Comparison(Verdict.ERROR, None))], {}))
    m.record(BackendRun("b", "openai", 2, [], {}, BackendUnavailable(ErrorKind.STOPPED, "not probed")))
    sample = m.registry.get_sample_value
    assert sample("canaryd_backend_probes_total", {"backend": "b"}) == 0  # nothing was sent
    assert sample("canaryd_canary_verdict", {"backend": "b", "canary": "add", "verdict": "error"}) is None
    assert sample("canaryd_backend_reachable", {"backend": "b"}) == 1  # from the first run, kept
