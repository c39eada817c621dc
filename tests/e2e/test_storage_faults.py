"""Storage faults on a real SQLite file: another writer holding the lock, a full disk (a small tmpfs), and
the daemon killed with SIGKILL mid-cycle. Afterwards the database passes `PRAGMA integrity_check`, nothing
recorded is lost or half-written, and a restarted daemon resumes and shows the gap in its metrics.

The backend is down on purpose: every pass then writes error observations as fast as the store allows,
which is what these faults need, with no model server in the way.
"""

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2
import pytest

from canaryd.lab.vllm_process import free_port
from tests.harness.services import wait_for

SUITE = """
[suite]
name = "s"
[[canary]]
id = "a"
prompt = "x"
[[canary]]
id = "b"
prompt = "y"
"""


def setup(root: Path, url: str = "", extra: str = "") -> Path:
    (root / "suite.toml").write_text(SUITE)
    cfg = root / "canaryd.toml"
    storage = f"[storage]\nurl = '{url}'\n" if url else ""
    cfg.write_text(
        f"state_dir = 'state'\nsuites = ['suite.toml']\n{extra}{storage}[[backends]]\nname = 'down'\n"
        "kind = 'openai'\nbase_url = 'http://127.0.0.1:9/v1'\nmodel = 'm'\nretries = 0\n"
    )
    return cfg


def canaryd(cfg: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "canaryd", "-c", str(cfg), *args], capture_output=True, text=True, timeout=120
    )


def count(db: Path) -> int:
    return sqlite3.connect(db).execute("select count(*) from observation").fetchone()[0]


def intact(db: Path) -> None:
    con = sqlite3.connect(db)
    assert con.execute("pragma integrity_check").fetchone()[0] == "ok"
    assert con.execute("pragma foreign_key_check").fetchall() == []
    # every observation is whole: its run exists and it carries a verdict and a comparison
    assert (
        con.execute(
            "select count(*) from observation o left join run r on r.id = o.run_id "
            "where r.id is null or o.verdict is null or o.comparison is null"
        ).fetchone()[0]
        == 0
    )


def hold_lock(db: Path, seconds: float, locked: threading.Event) -> None:
    con = sqlite3.connect(db, isolation_level=None)
    con.execute("begin exclusive")
    locked.set()
    time.sleep(seconds)
    con.execute("rollback")
    con.close()


def test_a_writer_holding_the_lock_is_waited_for_then_reported_in_one_line(tmp_path):
    db = tmp_path / "state" / "canaryd.db"
    cfg = setup(tmp_path, f"sqlite:///{db}?timeout=3")
    assert canaryd(cfg, "check").returncode == 3  # backend down: two error observations
    assert count(db) == 2

    locked = threading.Event()
    t = threading.Thread(target=hold_lock, args=(db, 1.0, locked))
    t.start()
    locked.wait()
    waited = canaryd(cfg, "check")  # the lock is released within the busy timeout: canaryd waits
    t.join()
    assert waited.returncode == 3 and count(db) == 4

    locked.clear()
    t = threading.Thread(target=hold_lock, args=(db, 8.0, locked))
    t.start()
    locked.wait()
    blocked = canaryd(cfg, "check")
    t.join()
    assert blocked.returncode == 4 and "Traceback" not in blocked.stderr
    assert blocked.stderr.startswith("canaryd: storage error:") and blocked.stderr.count("\n") == 1
    assert "locked" in blocked.stderr
    intact(db)
    assert count(db) == 4  # nothing recorded was lost


@pytest.fixture
def tiny_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_disk_is_a_storage_error_and_the_database_survives(tmp_path, tiny_disk):
    db = tiny_disk / "canaryd.db"
    cfg = setup(tmp_path, f"sqlite:///{db}")
    assert canaryd(cfg, "check").returncode == 3
    before = count(db)
    # fill the disk, leaving a few KiB
    free = os.statvfs(tiny_disk).f_bavail * os.statvfs(tiny_disk).f_frsize
    (tiny_disk / "ballast").write_bytes(b"\0" * max(0, free - 8 * 1024))
    codes = [canaryd(cfg, "check") for _ in range(8)]
    full = [p for p in codes if p.returncode == 4]
    assert full, [p.stderr for p in codes]
    assert all(p.stderr.startswith("canaryd: storage error:") and "Traceback" not in p.stderr for p in full)
    (tiny_disk / "ballast").unlink()
    intact(db)
    assert count(db) >= before
    assert canaryd(cfg, "check").returncode == 3  # with room again, recording resumes


def test_sigkill_mid_cycle_leaves_a_whole_database_and_the_restart_shows_the_gap(tmp_path):
    port = free_port()
    db = tmp_path / "state" / "canaryd.db"
    cfg = setup(tmp_path, extra=f"[daemon]\nlisten = '127.0.0.1:{port}'\n[[schedules]]\nevery = '1s'\n")
    metrics = f"http://127.0.0.1:{port}/metrics"
    for _ in range(3):
        d = subprocess.Popen(
            [sys.executable, "-m", "canaryd", "-c", str(cfg), "run"], stderr=subprocess.DEVNULL
        )
        try:
            wait_for(
                "passes", lambda: db.exists() and count(db) > 0 and httpx2.get(metrics).status_code == 200, 60
            )
            time.sleep(2.3)  # land somewhere inside a pass
        finally:
            d.send_signal(signal.SIGKILL)
            d.wait()
        intact(db)
    killed_at = time.time()
    n = count(db)

    # restarted on a schedule that does not fire at start: the metrics show the last probe before the kill
    cfg.write_text(cfg.read_text().replace("every = '1s'", "cron = '0 0 1 1 *'"))
    d = subprocess.Popen([sys.executable, "-m", "canaryd", "-c", str(cfg), "run"], stderr=subprocess.DEVNULL)
    try:
        text = wait_for("metrics", lambda: httpx2.get(metrics).text, 60)
        line = next(
            x
            for x in text.splitlines()
            if x.startswith('canaryd_canary_last_probe_timestamp_seconds{backend="down",canary="a"}')
        )
        assert float(line.split()[-1]) <= killed_at
    finally:
        d.terminate()
        assert d.wait(30) == 0
    assert count(db) == n

    # and on the old schedule it resumes probing
    cfg.write_text(cfg.read_text().replace("cron = '0 0 1 1 *'", "every = '1s'"))
    d = subprocess.Popen([sys.executable, "-m", "canaryd", "-c", str(cfg), "run"], stderr=subprocess.DEVNULL)
    try:
        wait_for("new observations", lambda: count(db) > n, 60)
    finally:
        d.terminate()
        assert d.wait(30) == 0
    intact(db)
