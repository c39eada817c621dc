"""A fleet on one database: daemons (`canaryd run` processes) sharing one config of scripted backends, each
with its own ``[daemon]`` section; what their passes were (the ``run`` table) and who holds which lease.
The failover tests (tests/e2e/test_failover.py) and bench/failover.py drive it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from datetime import UTC
from pathlib import Path

from sqlalchemy import create_engine, text

from canaryd.store.leases import spacing
from tests.harness.scripted_lab import PLAIN, free_port, scripted

INTERVAL = 2.0  # seconds between one backend's passes (the fast schedule)


class Fleet:
    """Daemons sharing ``backends`` scripted backends and one database; each has its own ``[daemon]``
    section (instance name, metrics port) and log file, and everything else is one config."""

    def __init__(
        self, root: Path, url: str, backends: int = 3, interval: float = INTERVAL, suite: str = PLAIN
    ) -> None:
        self.root, self.url, self.interval = root, url, interval
        self.backends = [f"b{i}" for i in range(1, backends + 1)]
        (root / "plain.toml").write_text(suite)
        self.common = (
            'state_dir = "state"\nsuites = ["plain.toml"]\n'
            + "".join(scripted(b) for b in self.backends)
            + f'[storage]\nurl = "{url}"\n'
            + f'[[schedules]]\nname = "fast"\nevery = "{interval}s"\n'
        )
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, int] = {}
        self.engine = create_engine(url)

    def start(self, instance: str) -> subprocess.Popen:
        self.ports[instance] = port = free_port()
        path = self.root / f"{instance}.toml"
        path.write_text(self.common + f'[daemon]\nlisten = "127.0.0.1:{port}"\ninstance = "{instance}"\n')
        with open(self.root / f"{instance}.log", "w") as log:
            self.procs[instance] = p = subprocess.Popen(
                [sys.executable, "-m", "canaryd", "-c", str(path), "run"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "NO_COLOR": "1"},
            )
        return p

    def log(self, instance: str) -> list[dict]:
        """The daemon's JSON log lines."""
        lines = (self.root / f"{instance}.log").read_text().splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]

    def wait_for(self, what, timeout: float, why: str):
        deadline = time.monotonic() + timeout
        while not (found := what()):
            for name, p in self.procs.items():
                if p.poll() is not None and p.returncode not in (0, -signal.SIGKILL):
                    raise AssertionError(f"{name} exited {p.returncode}: {self.tail(name)}")
            assert time.monotonic() < deadline, f"timed out waiting: {why}"
            time.sleep(0.1)
        return found

    def tail(self, instance: str) -> str:
        return (self.root / f"{instance}.log").read_text()[-3000:]

    def runs(self) -> list[tuple[str, str, float]]:
        """(backend, instance, start as Unix time) of every pass, in order."""
        with self.engine.connect() as c:
            rows = c.execute(text("SELECT backend, instance, started_at FROM run ORDER BY started_at"))
            return [(b, i, (t if t.tzinfo else t.replace(tzinfo=UTC)).timestamp()) for b, i, t in rows]

    def holders(self) -> dict[str, str]:
        """backend -> instance holding its lease now."""
        with self.engine.connect() as c:
            rows = c.execute(text("SELECT backend, holder FROM lease WHERE expires > now()"))
            return {b: h.split("#")[0] for b, h in rows}

    def metric(self, instance: str, name: str, backend: str) -> float | None:
        body = urllib.request.urlopen(f"http://127.0.0.1:{self.ports[instance]}/metrics", timeout=10).read()
        prefix = f'{name}{{backend="{backend}"'
        values = [
            float(line.rsplit(" ", 1)[1]) for line in body.decode().splitlines() if line.startswith(prefix)
        ]
        return max(values) if values else None

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        self.engine.dispose()


# How much later than its lease's mark (`Store.start_probes`) a run may start: the pool's queue, the machine.
RUN_SLACK_S = 0.25


def doubles(runs: list[tuple[str, str, float]], interval: float) -> int:
    """Passes of a backend closer to its previous one than the lease lets a probe follow another
    (`canaryd.store.leases.spacing`, less the `RUN_SLACK_S` of a run's start), at least half an interval:
    probed twice in one interval (one daemon's own passes are an interval apart)."""
    least = max(interval / 2, spacing(interval) - RUN_SLACK_S)
    last: dict[str, float] = {}
    n = 0
    for b, _, t in runs:
        if b in last and t - last[b] < least:
            n += 1
        last[b] = t
    return n


def gaps_after(runs: list[tuple[str, str, float]], dead: str, after: float) -> dict[str, float]:
    """For each backend ``dead`` probed last before ``after``: seconds from that last pass to the first
    pass after it by another daemon."""
    out: dict[str, float] = {}
    for b in {b for b, i, _ in runs if i == dead}:
        mine = [t for rb, i, t in runs if rb == b and i == dead and t <= after]
        others = [t for rb, i, t in runs if rb == b and i != dead and mine and t > mine[-1]]
        if mine and others:
            out[b] = others[0] - mine[-1]
    return out
