"""A fleet's joins and leaves over a long run: double probes and the longest gap, counted from the database.

``--daemons`` `canaryd run` daemons with one config (``--backends`` scripted backends, probed every
``--interval`` seconds) on one throw-away PostgreSQL database (as tests/harness/postgres.py starts it). Every
``--every`` seconds (± half, at random) one thing happens to a random daemon: a stopped one starts (a join),
or a live one is stopped with SIGTERM or killed with SIGKILL (a leave); at least one daemon stays live. After
``--duration`` seconds the script counts, from the ``run`` table (every pass of every backend, whoever
probed it):

* double probes: a backend probed again sooner than the lease lets a probe follow another
  (`canaryd.store.leases.spacing`, the interval less 5 %, at least 1 s), and sooner than half an interval;
* the longest gap between two probes of a backend, against the interval and the lease.

    .venv/bin/python bench/fleet_soak.py --duration 1800     # the issue's 30 minutes
    .venv/bin/python bench/fleet_soak.py --duration 120 --every 10
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from canaryd.store.leases import lease_seconds, spacing
from tests.harness.fleet import Fleet
from tests.harness.postgres import PostgresServer


def figures(runs: list[tuple[str, str, float]], interval: float) -> dict:
    """Double probes (under the lease's spacing; under half an interval) and gaps, per backend in order."""
    last: dict[str, float] = {}
    close = half = 0
    gaps: list[float] = []
    for b, _, t in runs:
        if b in last:
            gap = t - last[b]
            gaps.append(gap)
            close += gap < spacing(interval)
            half += gap < interval / 2
        last[b] = t
    gaps.sort()
    return {
        "passes": len(runs),
        "close": close,
        "half": half,
        "longest": gaps[-1] if gaps else 0.0,
        "p99": gaps[int(len(gaps) * 0.99)] if gaps else 0.0,
        "over_lease": sum(g > lease_seconds(interval) for g in gaps),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--daemons", type=int, default=4)
    ap.add_argument("--backends", type=int, default=12)
    ap.add_argument("--interval", type=float, default=3.0)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of joins and leaves")
    ap.add_argument("--every", type=float, default=20.0, help="seconds between events, on average")
    ap.add_argument("--seed", type=int, default=29)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    names = [f"d{i + 1}" for i in range(args.daemons)]
    events: Counter[str] = Counter()
    with PostgresServer() as pg, tempfile.TemporaryDirectory(prefix="canaryd-soak-") as tmp:
        fleet = Fleet(Path(tmp), pg.create_database("soak"), args.backends, args.interval)
        try:
            for n in names:
                fleet.start(n)
            t0 = time.monotonic()
            while time.monotonic() - t0 < args.duration:
                time.sleep(args.every * rng.uniform(0.5, 1.5))
                live = [n for n in names if fleet.procs[n].poll() is None]
                down = [n for n in names if n not in live]
                what = rng.choice(["join", "term", "kill"] if down and len(live) > 1 else ["term", "kill"])
                if what == "join" or len(live) <= 1:
                    if not down:
                        continue
                    what, n = "join", rng.choice(down)
                    fleet.start(n)
                else:
                    n = rng.choice(live)
                    fleet.procs[n].send_signal(signal.SIGTERM if what == "term" else signal.SIGKILL)
                    fleet.procs[n].wait(30)
                events[what] += 1
                print(
                    f"{time.monotonic() - t0:7.1f} s  {what:<4} {n}  "
                    f"(live now: {len(live) + (1 if what == 'join' else -1)})",
                    flush=True,
                )
            f = figures(fleet.runs(), args.interval)
        finally:
            fleet.stop()
    print(
        f"\n{args.daemons} daemons, {args.backends} backends every {args.interval:g} s, "
        f"{args.duration:.0f} s: {events['join']} joins, {events['term']} SIGTERMs, {events['kill']} SIGKILLs"
    )
    print(
        f"{'passes':>8}{'doubles (< spacing)':>21}{'(< half)':>10}{'longest gap':>13}{'p99 gap':>9}"
        f"{'> lease':>9}"
    )
    print(
        f"{f['passes']:>8}{f['close']:>21}{f['half']:>10}{f['longest']:>11.2f} s{f['p99']:>7.2f} s"
        f"{f['over_lease']:>9}"
    )
    print(f"(spacing {spacing(args.interval):.2f} s, lease {lease_seconds(args.interval):.2f} s)")


if __name__ == "__main__":
    main()
