"""A wall clock that steps (NTP correcting a wrong RTC, a VM resumed from a snapshot, an operator's
``date -s``) between passes, on scripted backends.

The clock is shifted where canaryd and APScheduler read it: ``time.time`` (the metrics' timestamps) and
``datetime.now`` in `canaryd.observation` (``utcnow``: every stored timestamp), `canaryd.daemon.service`
and APScheduler's scheduler and executors. Monotonic time is left alone, as a real step leaves it.

* the daemon's 1 s interval schedule keeps firing after the clock jumps back an hour (or forward);
* ``canaryd prune --older-than`` never deletes observations stamped "in the future" (what a backwards
  jump leaves behind), and baselines survive whatever the stamps say, so the next pass is still judged;
* the distinct-fingerprint count over ``[daemon] fingerprint_window`` stays right when time goes back: it
  never goes negative, and a fingerprint last seen more than a window ago (in elapsed time) ages out
  instead of being held until the wall clock catches up with its stamp.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import apscheduler.executors.base
import apscheduler.schedulers.base
import pytest

import canaryd.daemon.service
import canaryd.fields
import canaryd.observation
from canaryd.config import load_config
from canaryd.daemon import signals
from canaryd.daemon.service import Daemon
from tests.harness.scripted_lab import PLAIN, ScriptedLab, change, free_port, scripted, verdicts

IDS = ["add", "capital", "colors"]
DAY = 86_400.0
_real_time = time.time


class Clock:
    """The wall clock, ``offset`` seconds away from the real one."""

    def __init__(self) -> None:
        self.offset = 0.0

    def jump(self, seconds: float) -> None:
        self.offset += seconds

    def time(self) -> float:
        return _real_time() + self.offset

    def now(self, tz=None) -> datetime:
        return datetime.now(tz) + timedelta(seconds=self.offset)


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()

    class Shifted(datetime):
        @classmethod
        def now(cls, tz=None):  # type: ignore[override]
            return c.now(tz)

    monkeypatch.setattr(time, "time", c.time)
    for module in (
        canaryd.observation,
        canaryd.daemon.service,
        canaryd.fields,
        apscheduler.schedulers.base,
        apscheduler.executors.base,
    ):
        monkeypatch.setattr(module, "datetime", Shifted)
    return c


def write_config(root: Path, backends: str, window: str = "1h") -> Path:
    (root / "plain.toml").write_text(PLAIN)
    path = root / "canaryd.toml"
    path.write_text(
        f'state_dir = "state"\nsuites = {json.dumps(["plain.toml"])}\n'
        + backends
        + f'\n[daemon]\nlisten = "127.0.0.1:{free_port()}"\ninstance = "unit"\n'
        + f'fingerprint_window = "{window}"\n'
        + '[[schedules]]\nname = "fast"\nevery = "1s"\n'
    )
    return path


def value(d: Daemon, name: str, **labels: str) -> float | None:
    return d.metrics.registry.get_sample_value(name, labels)


def wait(what: str, check: Callable[[], object], timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def own_signals(monkeypatch) -> Iterator[None]:
    """`Daemon.serve_forever` takes SIGTERM/SIGINT/SIGHUP over (and `signals` carries a stop that came
    before over to the next daemon's events): each test starts with fresh ones, and the session gets its
    handlers back."""
    monkeypatch.setattr(signals, "_stop", threading.Event())
    monkeypatch.setattr(signals, "_reload", threading.Event())
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


# -- scheduling -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("jump", [-3600.0, 3600.0], ids=["back-1h", "forward-1h"])
def test_the_interval_schedule_keeps_firing_when_the_clock_jumps(
    tmp_path, clock, own_signals, monkeypatch, jump
):
    """The daemon as `canaryd run` runs it (`serve_forever` in the main thread, the scheduler's own
    threads): after the jump, passes go on at the 1 s interval instead of waiting for the wall clock to
    reach the next fire time computed before it (an hour away, for a jump back)."""

    def no_exit(code: int) -> None:  # a stop that gives up ends the process: here, the test session
        raise AssertionError(f"the daemon gave up waiting for a pass and called os._exit({code})")

    monkeypatch.setattr(canaryd.daemon.service.os, "_exit", no_exit)
    path = write_config(tmp_path, scripted())
    d = Daemon(path, load_config(path))
    runs = lambda: value(d, "canaryd_schedule_runs_total", schedule="fast") or 0  # noqa: E731
    seen: dict[str, BaseException] = {}

    def drive() -> None:
        try:
            wait("two passes", lambda: runs() >= 2)
            clock.jump(jump)
            before = runs()
            wait(f"two passes after a {jump:+.0f} s jump", lambda: runs() >= before + 2, timeout=10)
        except BaseException as e:  # reported by the test, once the daemon is stopped
            seen["error"] = e
        finally:
            d.stop_event.set()

    driver = threading.Thread(target=drive, name="clock-driver", daemon=True)
    driver.start()
    d.serve_forever()  # returns once the driver sets the stop event
    driver.join(timeout=30)
    if "error" in seen:
        raise seen["error"]
    # every pass was judged against the first: the jump changed the stamps, not the verdicts
    for c in IDS:
        assert value(d, "canaryd_canary_verdict", backend="fake", canary=c, verdict="identical") == 1, c
        stored = d.store.observations(backend="fake", canary_id=c, limit=1000)
        assert [o.verdict for o in stored].count("baseline") == 1, c


# -- prune --------------------------------------------------------------------------------------------------
def _stamps(lab: ScriptedLab) -> list[tuple[int, int, datetime]]:
    """(run id, observation id, started_at) of every stored observation, oldest id first."""
    rows = lab.store.observations(backend="fake", limit=1000)
    return sorted((o.run_id, o.id, o.started_at) for o in rows)


def test_prune_never_deletes_observations_from_the_future_and_baselines_survive(tmp_path, clock):
    """The clock ran two days ahead (a wrong RTC) for the first passes, baselines included, then stepped
    back to the real time for the next ones. ``canaryd prune`` (a real process, on the real clock) sees
    observations from the future: none may go, whatever the age, and the next pass is still judged."""
    lab = ScriptedLab(tmp_path, scripted())
    try:
        clock.jump(2 * DAY)
        assert set(verdicts(lab.cycle()).values()) == {"baseline"}
        assert set(verdicts(lab.cycle()).values()) == {"identical"}
        clock.jump(-2 * DAY)  # NTP steps the clock back
        for _ in range(2):
            assert set(verdicts(lab.cycle()).values()) == {"identical"}
        before = _stamps(lab)
        assert len(before) == 4 * len(IDS)
        future = [t for _, _, t in before if t.replace(tzinfo=t.tzinfo or UTC) > datetime.now(UTC)]
        assert len(future) == 2 * len(IDS)  # the first two passes' stamps are still ahead

        for args in (["1d", "--dry-run"], ["1d"], ["1h"]):
            p = lab.cli("prune", "--older-than", *args)
            assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
            verb = "would delete" if "--dry-run" in args else "deleted"
            assert p.stdout.startswith(f"{verb} 0 observations"), (args, p.stdout)
        assert _stamps(lab) == before

        baselines = lab.baselines(IDS)
        assert None not in baselines and set(baselines) <= {o for _, o, _ in before[: len(IDS)]}
        assert set(verdicts(lab.cycle()).values()) == {"identical"}  # still judged against them
    finally:
        lab.close()


def test_prune_after_the_clock_ran_behind_keeps_the_baselines_and_the_judgement(tmp_path, clock):
    """The other way round: the baselines were taken on the right clock, then it ran two days behind.
    Those passes' stamps look old to ``prune --older-than 1d`` and go, as their stamps say; the baselines
    (and what they are judged by) stay, and the next pass is judged against them, not re-baselined."""
    lab = ScriptedLab(tmp_path, scripted())
    try:
        assert set(verdicts(lab.cycle()).values()) == {"baseline"}
        baselines = lab.baselines(IDS)
        clock.jump(-2 * DAY)
        for _ in range(2):
            assert set(verdicts(lab.cycle()).values()) == {"identical"}
        clock.jump(2 * DAY)
        real = lab.cli("prune", "--older-than", "1d")
        assert real.returncode == 0 and "Traceback" not in real.stderr, real.stderr
        assert real.stdout.startswith(f"deleted {2 * len(IDS)} observations"), real.stdout
        left = _stamps(lab)
        assert sorted(o for _, o, _ in left) == sorted(baselines)
        assert lab.baselines(IDS) == baselines
        assert set(verdicts(lab.cycle()).values()) == {"identical"}
        # the database is whole: SQLite's own check, after the deletes
        db = lab.config.state_dir / "canaryd.db"
        with sqlite3.connect(db) as conn:
            assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
            assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
    finally:
        lab.close()


# -- the fingerprint window ---------------------------------------------------------------------------------
def test_the_fingerprint_window_counts_elapsed_time_when_the_clock_goes_back(tmp_path, clock):
    """Passes through `Daemon._pass` (what the scheduler runs), a 60 s window: fingerprint A, then the
    clock goes back a day and the backend answers B from then on. Both count while A is recent; once more
    than a window has elapsed since A, only B counts, though A's stamp is still a day ahead."""
    path = write_config(tmp_path, scripted(body=change(at=2, fingerprint="fp_b")), window="60s")
    d = Daemon(path, load_config(path))
    try:
        count = lambda: value(d, "canaryd_backend_fingerprints", backend="fake")  # noqa: E731
        d._pass("fast")
        assert count() == 1
        clock.jump(-DAY)
        d._pass("fast")
        assert count() == 2  # A a moment ago, B now
        clock.jump(30)
        d._pass("fast")
        assert count() == 2  # A 30 s ago: still inside the window
        clock.jump(31)
        d._pass("fast")
        assert count() == 1, "a fingerprint seen more than a window ago still counts"
        for _ in range(3):  # and from here on it is B alone, never negative, never stuck
            clock.jump(-10)
            d._pass("fast")
            assert count() == 1
        clock.jump(DAY)  # the clock steps forward again: B was seen moments ago
        d._pass("fast")
        assert count() == 1
        for c in IDS:
            assert value(d, "canaryd_canary_probe_success", backend="fake", canary=c) == 1
    finally:
        d.stop()
