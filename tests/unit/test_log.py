"""Log lines as journald files them: a ``<N>`` syslog priority prefix only when stderr is the journal stream.

The journal stream is stood in for by a regular file: systemd's test is the same (``JOURNAL_STREAM`` equals
stderr's device and inode), and the lines can be read back.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from canaryd import log as logsetup

LEVELS = ("debug", "info", "warning", "error", "critical")
EMIT = f"""
from canaryd import log
log.configure("debug")
import structlog
logger = structlog.get_logger("canaryd")
for level in {LEVELS!r}:
    getattr(logger, level)("hello", n=1)
try:
    1 / 0
except ZeroDivisionError:
    logger.exception("boom")
import logging
logging.getLogger("apscheduler.executors.default").warning("Run time of job %s was missed", "p")
logging.getLogger("apscheduler.scheduler").info("Added job")  # libraries: warnings and worse only
"""
# What reaches stderr, in order: each structlog level, the exception, the library's warning.
EXPECTED = (*LEVELS, "error", "warning")


def stream_id(path: Path) -> str:
    st = os.stat(path)
    return f"{st.st_dev}:{st.st_ino}"


def emit(stderr_file: Path, journal_stream: str | None) -> list[str]:
    """The stderr lines of a process logging at each level, an exception and a library's warning."""
    env = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
    if journal_stream is not None:
        env["JOURNAL_STREAM"] = journal_stream
    with stderr_file.open("wb") as err:
        subprocess.run([sys.executable, "-c", EMIT], stderr=err, env=env, check=True, timeout=60)
    return stderr_file.read_text().splitlines()


def test_on_the_journal_each_line_carries_its_levels_priority(tmp_path):
    path = tmp_path / "stderr"
    path.touch()
    lines = emit(path, stream_id(path))
    assert len(lines) == len(EXPECTED)  # the traceback stays inside its one JSON line
    records = []
    for line, level in zip(lines, EXPECTED, strict=True):
        prefix = f"<{logsetup.PRIORITY[level]}>"
        assert line.startswith(prefix), line
        records.append(json.loads(line.removeprefix(prefix)))  # after the prefix, the same JSON as ever
        assert records[-1]["level"] == level
    assert "ZeroDivisionError" in records[-2]["exception"]
    assert records[-1]["logger"] == "apscheduler.executors.default" and "missed" in records[-1]["event"]
    # systemd's mapping: warning and worse are what `journalctl -p warning` shows
    assert [line[:3] for line in lines] == ["<7>", "<6>", "<4>", "<3>", "<2>", "<3>", "<4>"]


@pytest.mark.parametrize("journal_stream", [None, "", "garbage", "1:2:3", "other-inode"])
def test_elsewhere_lines_stay_plain_json(tmp_path, journal_stream):
    """No variable, a malformed one, or one naming another stream (stderr redirected since systemd set it)."""
    path = tmp_path / "stderr"
    path.touch()
    if journal_stream == "other-inode":
        other = tmp_path / "other"
        other.touch()
        journal_stream = stream_id(other)
    lines = emit(path, journal_stream)
    assert [json.loads(line)["level"] for line in lines] == list(EXPECTED)


def test_stderr_is_journal_compares_device_and_inode(tmp_path, monkeypatch):
    path = tmp_path / "stream"
    path.touch()
    dev, ino = stream_id(path).split(":")
    with path.open("w") as stream:
        monkeypatch.setenv("JOURNAL_STREAM", f"{dev}:{ino}")
        assert logsetup.stderr_is_journal(stream)
        monkeypatch.setenv("JOURNAL_STREAM", f"{int(dev) + 1}:{ino}")
        assert not logsetup.stderr_is_journal(stream)
        monkeypatch.delenv("JOURNAL_STREAM")
        assert not logsetup.stderr_is_journal(stream)


def test_journal_prefix_of_an_unknown_level_is_info():
    assert logsetup.journal_prefix("notice-ish") == "<6>"


@pytest.mark.parametrize("on_journal", [True, False])
def test_the_clis_error_line_carries_the_error_priority_on_the_journal_only(tmp_path, on_journal):
    path = tmp_path / "stderr"
    path.touch()
    env = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
    if on_journal:
        env["JOURNAL_STREAM"] = stream_id(path)
    with path.open("wb") as err:
        cmd = [sys.executable, "-m", "canaryd", "-c", str(tmp_path / "missing.toml"), "validate"]
        p = subprocess.run(cmd, stderr=err, env=env, timeout=60)
    assert p.returncode == 2
    (line,) = path.read_text().splitlines()
    assert line.startswith(("<3>" if on_journal else "") + "canaryd: error: ") and "missing.toml" in line
