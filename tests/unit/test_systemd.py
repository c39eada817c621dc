"""The systemd unit as the daemon needs it, and the sd_notify client.

* ``systemd/canaryd.service`` says what the daemon does (``Type=notify``, reload by SIGHUP, exit 2 not
  restarted, a watchdog). ``systemd-analyze verify`` and ``security --offline``, and the unit's syscall
  filter around canaryd's real runtime, are in tests/e2e/test_systemd.py.
* ``canaryd.daemon.sdnotify`` against a real AF_UNIX datagram socket bound by the test (path and abstract
  names).
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from pathlib import Path

import pytest

from canaryd.daemon import sdnotify

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
UNIT = REPO / "systemd" / "canaryd.service"


def _unit_settings(text: str) -> list[tuple[str, str]]:
    return [
        (k.strip(), v.strip())
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith(("#", ";", "["))
        for k, v in [line.split("=", 1)]
    ]


def test_unit_matches_what_the_daemon_does():
    from canaryd.cli import EXIT_USAGE

    settings = dict(_unit_settings(UNIT.read_text(encoding="utf-8")))
    assert settings["Type"] == "notify"
    assert settings["ExecStart"] == "/usr/local/bin/canaryd --config /etc/canaryd/canaryd.toml run"
    assert settings["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert settings["RestartPreventExitStatus"] == str(EXIT_USAGE)  # bad config must not flap
    assert settings["WatchdogSec"]
    assert settings["StateDirectory"] == settings["ConfigurationDirectory"] == "canaryd"


# --- canaryd.daemon.sdnotify against a real datagram socket -------------------------------------------------


@pytest.fixture(params=["path", "abstract"])
def notify_socket(request, tmp_path: Path, monkeypatch):
    """A bound AF_UNIX datagram socket, with $NOTIFY_SOCKET naming it as systemd would."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.settimeout(5)
    if request.param == "path":
        address = str(tmp_path / "notify")
        sock.bind(address)
        monkeypatch.setenv("NOTIFY_SOCKET", address)
    else:
        name = f"canaryd-test-{uuid.uuid4().hex}"
        sock.bind("\0" + name)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    with sock:
        yield sock


def test_notify_sends_exactly_one_datagram(notify_socket: socket.socket):
    assert sdnotify.notify("READY=1", "STATUS=x") is True
    assert notify_socket.recv(4096) == b"READY=1\nSTATUS=x"
    assert sdnotify.notify("WATCHDOG=1") is True
    assert notify_socket.recv(4096) == b"WATCHDOG=1"


def test_notify_flattens_newlines_inside_a_state(notify_socket: socket.socket):
    assert sdnotify.notify("STATUS=reload failed:\nline 2", "ERRNO=22")
    assert notify_socket.recv(4096) == b"STATUS=reload failed: line 2\nERRNO=22"


def test_reloading_sends_monotonic_usec(notify_socket: socket.socket):
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert sdnotify.reloading("STATUS=reloading")
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    lines = notify_socket.recv(4096).decode().split("\n")
    assert lines[0] == "RELOADING=1" and lines[2] == "STATUS=reloading"
    key, usec = lines[1].split("=")
    assert key == "MONOTONIC_USEC" and before <= int(usec) <= after


def test_notify_never_blocks_on_a_listener_that_stopped_reading(notify_socket: socket.socket):
    """The queue of an unread datagram socket fills after a few messages; then notify gives up at once."""
    t0 = time.monotonic()
    sent = [sdnotify.notify("WATCHDOG=1") for _ in range(500)]
    assert time.monotonic() - t0 < 5 and sent[0] is True and sent[-1] is False


def test_notify_without_a_socket_is_a_silent_no_op(monkeypatch, tmp_path: Path):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.notify("READY=1") is False
    assert sdnotify.reloading() is False
    for unusable in ("", "vsock:2:1234", "relative/path", str(tmp_path / "nobody-listens")):
        monkeypatch.setenv("NOTIFY_SOCKET", unusable)
        assert sdnotify.notify("READY=1") is False


def test_notify_with_no_states_sends_nothing(notify_socket: socket.socket):
    assert sdnotify.notify() is False
    notify_socket.settimeout(0.05)
    with pytest.raises(TimeoutError):
        notify_socket.recv(4096)


@pytest.mark.parametrize(
    ("usec", "pid", "expected"),
    [
        ("60000000", None, 30.0),
        ("60000000", "self", 30.0),
        ("1000000", None, 0.5),
        ("60000000", "other", None),
        (None, None, None),
        ("0", None, None),
        ("-5", None, None),
        ("sixty", None, None),
        ("60000000", "garbage", None),
    ],
)
def test_watchdog_period(monkeypatch, usec, pid, expected):
    for name, value in (("WATCHDOG_USEC", usec), ("WATCHDOG_PID", pid)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            value = {"self": str(os.getpid()), "other": str(os.getpid() + 1)}.get(value, value)
            monkeypatch.setenv(name, value)
    assert sdnotify.watchdog_period() == expected
