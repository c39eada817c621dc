"""Failover of a fleet: two `canaryd run` daemons with one config on one PostgreSQL database.

Scripted backends (no network) on a short interval. The script starts a throw-away PostgreSQL (as
tests/harness/postgres.py does) and two daemons, then ``--rounds`` times: lets both live ``--live`` intervals,
kills the holder (SIGKILL on even rounds, SIGTERM on odd ones) and waits for the other to take over, then
restarts the dead one as a standby. It prints, side by side:

* double probes per interval while both live (passes of one backend closer than half an interval), out of
  the passes run;
* the gap in probing after SIGKILL and after SIGTERM: seconds from the dead daemon's last pass of a backend
  to the survivor's first, and how much longer than a normal interval it was (both: the survivor asks just
  before the dead daemon's next pass was due; a killed daemon's presence connection died with it, a
  stopped one released its leases).

    .venv/bin/python bench/failover.py [--interval 2] [--backends 3] [--rounds 4] [--live 5]
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from canaryd.daemon.service import TAKEOVER_EARLY_S
from canaryd.store import lease_seconds
from tests.harness.fleet import Fleet, doubles, gaps_after
from tests.harness.postgres import PostgresServer


def started(fleet: Fleet, name: str) -> bool:
    return any(e["event"] == "started" for e in fleet.log(name))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("--backends", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--live", type=int, default=5, help="intervals with both daemons alive, per round")
    args = ap.parse_args()
    interval, lease = args.interval, lease_seconds(args.interval)
    gaps: dict[str, list[float]] = {"SIGKILL": [], "SIGTERM": []}
    live_runs, live_doubles = 0, 0
    with PostgresServer() as pg, tempfile.TemporaryDirectory(prefix="canaryd-failover-") as tmp:
        fleet = Fleet(Path(tmp), pg.create_database("fleet"), backends=args.backends, interval=interval)
        try:
            for name in ("d1", "d2"):
                fleet.start(name)
            fleet.wait_for(lambda: started(fleet, "d1") and started(fleet, "d2"), 120, "start")
            names = iter(f"d{n}" for n in range(3, 1000))  # a restart is a new instance: its runs stay apart
            for r in range(args.rounds):
                t0 = time.time()
                time.sleep(args.live * interval)
                window = [x for x in fleet.runs() if x[2] >= t0]
                live_runs += len(window)
                live_doubles += doubles(window, interval)
                holders = fleet.holders()
                victim = holders[min(holders)]
                heir = next(i for i in fleet.procs if i != victim)
                sig = signal.SIGKILL if r % 2 == 0 else signal.SIGTERM
                fleet.procs[victim].send_signal(sig)
                fleet.procs[victim].wait(timeout=60)
                dead_at = time.time()
                theirs = {b for b, h in holders.items() if h == victim}
                fleet.wait_for(
                    lambda: {b for b, i, t in fleet.runs() if i == heir and t > dead_at} >= theirs,  # noqa: B023
                    lease + 2 * interval + 30,
                    "takeover",
                )
                gaps[sig.name] += gaps_after(fleet.runs(), victim, dead_at).values()
                del fleet.procs[victim]
                standby = next(names)
                fleet.start(standby)
                fleet.wait_for(lambda: started(fleet, standby), 120, "restart")  # noqa: B023
        finally:
            fleet.stop()

    print(f"fleet: 2 daemons, {args.backends} scripted backends, interval {interval:g}s, lease {lease:g}s")
    print(
        f"double probes while both live: {live_doubles} in {live_runs} passes "
        f"({args.rounds} rounds × {args.live} intervals)"
    )
    print(f"{'handover':<10}{'n':>4}{'gap min':>10}{'median':>10}{'max':>10}{'max - interval':>16}")
    for how, g in gaps.items():
        if g:
            print(
                f"{how:<10}{len(g):>4}{min(g):>9.2f}s{statistics.median(g):>9.2f}s{max(g):>9.2f}s"
                f"{max(g) - interval:>15.2f}s"
            )
    print(
        f"(gap: the dead daemon's last pass of a backend to the survivor's first; a daemon's own passes are "
        f"{interval:g}s apart. The survivor asks {TAKEOVER_EARLY_S:g}s before the dead daemon's next pass "
        f"was due: SIGKILL ended its presence connection, SIGTERM released its leases; a hung daemon's "
        f"lease would end {lease:g}s after its last pass)"
    )


if __name__ == "__main__":
    main()
