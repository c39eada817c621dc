"""canaryd's log lines in a real journal: the priority journald files them at, and what ``-p warning`` shows.

The test starts its own systemd-journald in a journal namespace of its own (``systemd-journald NAMESPACE``:
sockets under /run/systemd/journal.NAMESPACE, so the host's journal, if any, is untouched), connects a
stream to it as systemd does for a service's stderr (the stream header, then ``JOURNAL_STREAM`` naming the
socket's device and inode) and runs ``canaryd check`` against a closed port (info lines and the
``backend_unavailable`` warning), then ``canaryd run`` with a missing config (its one ``canaryd: error:``
line). Needs root (journald's directories), as CI runs.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

JOURNALD = "/lib/systemd/systemd-journald"
IDENT = "canaryd-e2e"
SUITE = """
[suite]
name = "t"
[[canary]]
id = "add"
messages = [{ role = "user", content = "What is 17 + 25?" }]
expect = { number = 42 }
"""


@pytest.fixture
def journal_namespace():
    """A running journald of a fresh namespace; its files are removed afterwards."""
    if os.geteuid() != 0 or not os.path.exists(JOURNALD) or not shutil.which("journalctl"):
        pytest.fail("needs root, systemd-journald and journalctl (Debian's systemd package)")
    ns = f"canaryd{os.getpid()}"
    proc = subprocess.Popen([JOURNALD, ns], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    stdout = Path(f"/run/systemd/journal.{ns}/stdout")
    deadline = time.monotonic() + 20
    while not stdout.exists():
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "journald did not create its stdout socket"
        time.sleep(0.05)
    try:
        yield ns
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        machine = Path("/etc/machine-id").read_text().strip()
        for d in (f"/run/systemd/journal.{ns}", f"/run/log/journal/{machine}.{ns}"):
            shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(f"/var/log/journal/{machine}.{ns}", ignore_errors=True)


def journal_stream(ns: str) -> socket.socket:
    """A stream into the namespace's journal, as systemd sets up a unit's stderr (level prefixes on)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(f"/run/systemd/journal.{ns}/stdout")
    # identifier, unit, default priority, level prefix, forward to syslog, kmsg, console (journald-stream.c)
    s.sendall(f"{IDENT}\n\n6\n1\n0\n0\n0\n".encode())
    s.shutdown(socket.SHUT_RD)
    return s


def entries(ns: str, *args: str, count: int) -> list[dict]:
    """The namespace's entries of this test's identifier, once at least ``count`` arrived (stream lines are
    written asynchronously)."""
    deadline = time.monotonic() + 20
    while True:
        p = subprocess.run(
            ["journalctl", f"--namespace={ns}", "-t", IDENT, "-o", "json", "--no-pager", *args],
            capture_output=True,
            text=True,
            timeout=30,
        )
        rows = [json.loads(line) for line in p.stdout.splitlines()]
        if len(rows) >= count or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


def test_journalctl_p_warning_shows_canaryds_warnings_and_not_its_info(journal_namespace, tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed once the block ends: connections are refused
    (tmp_path / "suite.toml").write_text(SUITE)
    cfg = tmp_path / "canaryd.toml"
    cfg.write_text(
        f"state_dir = 'state'\nsuites = ['suite.toml']\n[[backends]]\nname = 'down'\nkind = 'vllm'\n"
        f"base_url = 'http://127.0.0.1:{port}/v1'\nmodel = 'm'\ntimeout_s = 5\nconnect_timeout_s = 1\n"
        "retries = 0\n"
    )
    stream = journal_stream(journal_namespace)
    with stream:
        st = os.fstat(stream.fileno())
        env = dict(os.environ, JOURNAL_STREAM=f"{st.st_dev}:{st.st_ino}")
        p = subprocess.run(
            [sys.executable, "-m", "canaryd", "--log-level", "info", "-c", str(cfg), "check"],
            stdout=subprocess.DEVNULL,
            stderr=stream.fileno(),
            env=env,
            timeout=120,
        )
    assert p.returncode == 3  # the backend could not be judged

    # every log line at its level's priority, the prefix stripped and the JSON intact (the report's own
    # "canaryd: backend 'down' …" line is plain text at the default priority)
    rows = entries(journal_namespace, count=3)
    lines = [(int(r["PRIORITY"]), json.loads(r["MESSAGE"])) for r in rows if r["MESSAGE"].startswith("{")]
    assert (4, "backend_unavailable") in {(pri, rec["event"]) for pri, rec in lines}
    assert {rec["level"] for _, rec in lines} >= {"info", "warning"}
    assert all(pri == {"info": 6, "warning": 4, "error": 3}[rec["level"]] for pri, rec in lines), lines

    shown = entries(journal_namespace, "-p", "warning", count=1)
    assert shown and all(json.loads(r["MESSAGE"])["level"] in ("warning", "error", "critical") for r in shown)
    assert "backend_unavailable" in {json.loads(r["MESSAGE"])["event"] for r in shown}


def test_a_config_error_is_filed_as_an_error(journal_namespace, tmp_path):
    """Why a unit failed to start (exit 2) is what `journalctl -p err` shows."""
    with journal_stream(journal_namespace) as stream:
        st = os.fstat(stream.fileno())
        env = dict(os.environ, JOURNAL_STREAM=f"{st.st_dev}:{st.st_ino}")
        p = subprocess.run(
            [sys.executable, "-m", "canaryd", "-c", str(tmp_path / "missing.toml"), "run"],
            stderr=stream.fileno(),
            env=env,
            timeout=120,
        )
    assert p.returncode == 2
    (row,) = entries(journal_namespace, "-p", "err", count=1)
    assert row["MESSAGE"].startswith("canaryd: error: ") and "missing.toml" in row["MESSAGE"]
    assert row["PRIORITY"] == "3"
