"""Planning figures for a large deployment: --canaries × --backends (default 1,000 × 10) at --interval.

Measured here, without a model server: the metrics exposition (series, bytes, render time) after one pass of
every canary on every backend; canaryd's own CPU and storage per observation on the real Store (SQLite),
for a day in which nothing changes and one in which every answer changes. Per-probe server latency is the
backend's business and is left out. Prints a table.

    .venv/bin/python bench/planning.py [--canaries 1000] [--backends 10] [--interval 300]
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from prometheus_client import generate_latest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from canaryd.daemon.metrics import Metrics
from canaryd.judge.compare import compare
from canaryd.observation import Observation, TokenLogprob
from canaryd.probe.run import BackendRun, Result
from canaryd.store import Store

STACK = {"vllm.version": "0.32.0", "response.system_fingerprint": "vllm-0.32.0-1a0c594b", "models.root": "/m"}


def observation(backend: str, canary: str, variant: int) -> Observation:
    o = Observation(backend, canary, "default", datetime.now(UTC), {"model": "m", "messages": canary}, canary)
    o.text = f"answer {variant}"
    o.tokens = [
        TokenLogprob(
            f"t{i}", -0.01 * i - variant * 1e-3, i, None, tuple((f"a{j}", -1.0 * j) for j in range(5))
        )
        for i in range(16)
    ]
    o.system_fingerprint, o.prompt_tokens, o.completion_tokens, o.latency_s = (
        STACK["response.system_fingerprint"],
        20,
        16,
        0.1,
    )
    o.stack = dict(STACK)
    return o


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--canaries", type=int, default=1000)
    ap.add_argument("--backends", type=int, default=10)
    ap.add_argument("--interval", type=float, default=300, help="seconds between passes")
    ap.add_argument(
        "--sample", type=int, default=2000, help="observations written to measure storage and CPU"
    )
    args = ap.parse_args()
    per_day = 86400 / args.interval * args.canaries * args.backends

    metrics = Metrics()
    for b in range(args.backends):
        results = []
        for c in range(args.canaries):
            o = observation(f"backend-{b}", f"canary-{c}", 0)
            results.append(Result(0, 0, o, compare(o, o, correct=True, baseline_correct=True)))
        metrics.record(BackendRun(f"backend-{b}", "vllm", 0, results, dict(STACK)))
    t0 = time.perf_counter()
    body = generate_latest(metrics.registry)
    render_s = time.perf_counter() - t0
    series = sum(1 for line in body.decode().splitlines() if line and not line.startswith("#"))

    rows = []
    with tempfile.TemporaryDirectory() as d:
        for label, changing in (("nothing changes", False), ("every answer changes", True)):
            db = Path(d) / f"{changing}.db"
            store = Store(f"sqlite:///{db}")
            run = store.start_run("backend-0")
            base = observation("backend-0", "canary-0", 0)
            store.add_observation(run, base, compare(None, base, correct=True), None)
            cpu0, size0 = time.process_time(), db.stat().st_size
            for i in range(args.sample):
                o = observation("backend-0", f"canary-{i % 50}", i if changing else 0)
                store.add_observation(run, o, compare(base, o, correct=True, baseline_correct=True), 1)
            cpu = (time.process_time() - cpu0) / args.sample
            store.close()
            sqlite3.connect(db).execute("pragma wal_checkpoint(truncate)").close()
            per_obs = (db.stat().st_size - size0) / args.sample
            rows.append((label, per_obs, cpu))

    print(
        f"canaryd planning: {args.canaries:,} canaries × {args.backends} backends, "
        f"a pass every {args.interval:g} s "
        f"({per_day:,.0f} observations/day)"
    )
    print(f"  /metrics series                      {series:,}")
    print(f"  /metrics size / render time          {len(body) / 1e6:.1f} MB / {render_s * 1000:.0f} ms")
    for label, per_obs, cpu in rows:
        print(f"  store+compare CPU per observation    {cpu * 1000:.2f} ms ({label})")
        print(
            f"  storage per observation / per day    {per_obs:,.0f} B / "
            f"{per_obs * per_day / 1e6:,.0f} MB ({label})"
        )
    print(
        f"  canaryd CPU per pass of all canaries {rows[0][2] * args.canaries * args.backends:.1f} s "
        f"(of {args.interval:g} s; client time on top, see probe_bench.py)"
    )


if __name__ == "__main__":
    main()
