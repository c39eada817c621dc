"""Per-probe cost, storage per observation, daemon memory over many cycles, and /metrics scrape latency.

Runs against a real vLLM (CPU) server serving the tiny test model, so it needs the venv from
``./setup.sh``. Prints a table; nothing is asserted (targets live here, not in timed tests).

    .venv/bin/python bench/probe_bench.py [--passes 20] [--cycles 288]
"""

from __future__ import annotations

import argparse
import os
import resource
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx2

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from canaryd import log  # noqa: E402
from canaryd.config import load_config  # noqa: E402
from canaryd.daemon.service import Daemon  # noqa: E402
from canaryd.lab.tinymodel import build_tiny_model  # noqa: E402
from canaryd.lab.vllm_process import VLLMServer, free_port  # noqa: E402
from canaryd.probe.run import one_pass  # noqa: E402

CONFIG = """
state_dir = "state"
suites = ["{suite}"]
[daemon]
listen = "127.0.0.1:{metrics_port}"
[[backends]]
name = "local"
kind = "vllm"
base_url = "{base_url}"
model = "tiny"
concurrency = 4
"""


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passes", type=int, default=20, help="probe passes for the per-probe figures")
    ap.add_argument(
        "--cycles", type=int, default=288, help="daemon passes for the memory figure (288 = a day at 5m)"
    )
    args = ap.parse_args()
    log.configure("warning")

    work = Path(tempfile.mkdtemp(prefix="canaryd-bench-"))
    model = build_tiny_model(REPO / ".cache" / "test-models" / "random-seed0", seed=0)
    port, metrics_port = free_port(), free_port()
    (work / "canaryd.toml").write_text(
        CONFIG.format(
            suite=REPO / "canaries" / "default.toml",
            metrics_port=metrics_port,
            base_url=f"http://127.0.0.1:{port}/v1",
        )
    )
    config = load_config(work / "canaryd.toml")
    rows: list[tuple[str, str]] = []
    with VLLMServer(model, port=port, extra_args=["--enforce-eager"], log_path=work / "vllm.log"):
        one_pass(config)  # baselines (and warm-up)
        wall, cpu, latencies, n = [], 0.0, [], 0
        for _ in range(args.passes):
            c0, t0 = time.process_time(), time.perf_counter()
            results = [r for run in one_pass(config) for r in run.results]
            wall.append(time.perf_counter() - t0)
            cpu += time.process_time() - c0
            latencies += [r.observation.latency_s for r in results]
            n += len(results)
        db = work / "state" / "canaryd.db"
        con = sqlite3.connect(db)
        con.execute("pragma wal_checkpoint(truncate)")
        obs = con.execute("select count(*) from observation").fetchone()[0]
        payload = con.execute("select coalesce(sum(length(data)), 0), count(*) from payload").fetchone()
        rows += [
            ("canaries per pass", str(n // args.passes)),
            (
                "pass wall time (probe → verdict, all canaries), median",
                f"{statistics.median(wall) * 1000:.0f} ms",
            ),
            ("server latency per probe, median", f"{statistics.median(latencies) * 1000:.1f} ms"),
            ("canaryd CPU per probe (client, store, compare)", f"{cpu / n * 1000:.2f} ms"),
            ("observations stored", str(obs)),
            ("database bytes per observation", f"{db.stat().st_size / obs:.0f} B"),
            ("distinct payloads / their bytes", f"{payload[1]} / {payload[0]} B"),
        ]

        # The daemon over many cycles: memory after a day-equivalent of passes, and scrape latency.
        daemon = Daemon(work / "canaryd.toml", config)
        daemon.start()
        daemon.scheduler.pause()
        rss0 = rss_mib()
        t0 = time.perf_counter()
        for _ in range(args.cycles):
            daemon._pass("default")
        cycle_s = (time.perf_counter() - t0) / args.cycles
        rss1 = rss_mib()
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        scrape = []
        with httpx2.Client() as client:  # one client, as a Prometheus server keeps its connection
            for _ in range(50):
                t = time.perf_counter()
                body = client.get(url).content
                scrape.append(time.perf_counter() - t)
        daemon.stop()
        p50, p95 = statistics.median(scrape) * 1000, statistics.quantiles(scrape, n=20)[-1] * 1000
        rows += [
            (f"daemon RSS before / after {args.cycles} passes", f"{rss0:.0f} / {rss1:.0f} MiB"),
            ("daemon pass time, mean", f"{cycle_s * 1000:.0f} ms"),
            (
                "peak RSS of the bench process",
                f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB",
            ),
            (
                "/metrics scrape latency, median / p95",
                f"{p50:.1f} / {p95:.1f} ms ({len(body)} bytes)",
            ),
        ]
    width = max(len(k) for k, _ in rows)
    print(f"canaryd probe bench ({os.cpu_count()} cores, vLLM CPU, tiny model)")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


if __name__ == "__main__":
    main()
