"""``/metrics`` at scale: series, bytes, render time per pass and scrape latency, for the lean cached
layout of ``canaryd.daemon.metrics``, side by side with main's per-pair layout (figures measured on main
before the change, printed for reference) and with rendering the same registry on every scrape.

Drives the `Metrics` object directly with synthetic probe passes (no server, no store) and times GETs to
the real `MetricsServer`. Prints a table; nothing is asserted (targets live here, not in timed tests).

    .venv/bin/python bench/metrics_bench.py [--canaries 1000] [--backends 10] [--scrapes 200]
"""

from __future__ import annotations

import argparse
import gzip
import http.client
import statistics
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

from prometheus_client import generate_latest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from canaryd.daemon.httpserver import MetricsServer  # noqa: E402
from canaryd.daemon.metrics import Metrics  # noqa: E402
from canaryd.judge.compare import compare  # noqa: E402
from canaryd.observation import ErrorKind, Observation, TokenLogprob  # noqa: E402
from canaryd.probe.run import BackendRun, Result  # noqa: E402

# main (commit ea02a08), 10,000 canary × backend pairs, measured by the lead engineer on this machine
MAIN = {"series": 300_070, "bytes": 27_000_000, "render_s": 6.2, "per_pair": 30}
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,"
    "text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
)


def observation(backend: str, canary: str, i: int) -> Observation:
    o = Observation(backend, canary, "s", datetime(2026, 1, 1, tzinfo=UTC), {}, "r")
    if i % 50 == 0:  # some failures, some drift, most identical: every series kind is present
        o.error, o.error_kind = "boom", ErrorKind.HTTP_5XX
    else:
        o.text, o.system_fingerprint, o.latency_s = "42", "fp", 0.01 * (i % 100)
        o.tokens = [TokenLogprob("42", -0.5 - (0.3 if i % 7 == 0 else 0.0))]
    return o


def passes(backends: int, canaries: int) -> list[BackendRun]:
    runs = []
    for b in range(backends):
        name, results = f"backend-{b}", []
        for c in range(canaries):
            base = observation(name, f"canary-{c}", 1)
            o = observation(name, f"canary-{c}", c)
            results.append(Result(1, 1, o, compare(base, o, correct=not o.error, baseline_correct=True)))
        runs.append(BackendRun(name, "vllm", 1, results, {"vllm.version": "0.32.0"}))
    return runs


def scrape(port: int, headers: dict[str, str]) -> tuple[float, bytes, dict]:
    t = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics", headers=headers)
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return time.perf_counter() - t, body, dict(resp.getheaders())


def p95(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=20)[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--canaries", type=int, default=1000, help="canaries per backend")
    ap.add_argument("--backends", type=int, default=10)
    ap.add_argument("--scrapes", type=int, default=200, help="GETs timed per format")
    args = ap.parse_args()
    pairs = args.canaries * args.backends

    m = Metrics()
    runs = passes(args.backends, args.canaries)
    m.set_intervals((r.backend, res.observation.canary_id, 300.0) for r in runs for res in r.results)
    t = time.perf_counter()
    for r in runs:
        m.record(r)
    record_s = time.perf_counter() - t
    renders = []
    for _ in range(3):
        t = time.process_time()
        m.publish()
        m.exposition()  # the first scrape after a publish renders it
        renders.append(time.process_time() - t)
    body, _ = m.exposition()
    series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
    t = time.process_time()
    generate_latest(m.registry)  # what a scrape would cost rendering this registry every time
    every_scrape_s = time.process_time() - t

    server = MetricsServer(("127.0.0.1", 0), m)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    timings = {}
    for label, headers in (
        ("Prometheus (OpenMetrics, gzip)", {"Accept": PROMETHEUS_ACCEPT, "Accept-Encoding": "gzip"}),
        ("plain text, no gzip", {}),
    ):
        xs = []
        for _ in range(args.scrapes):
            dt, raw, got = scrape(port, headers)
            xs.append(dt)
        if got.get("Content-Encoding") == "gzip":
            gz_bytes, raw = len(raw), gzip.decompress(raw)
            timings["gzip bytes"] = gz_bytes
        timings[label] = xs
    server.shutdown()

    print(f"{pairs:,} canary × backend pairs ({args.backends} backends × {args.canaries} canaries)\n")
    row("figure", "main (per-pair layout)", "lean, cached", "target")
    row("series", f"{MAIN['series']:,}", f"{series:,}", "≤ 50,000")
    row("series per canary × backend", MAIN["per_pair"], f"{series / pairs:.2f}")
    row("exposition, text", f"{MAIN['bytes'] / 1e6:.1f} MB", f"{len(body) / 1e6:.2f} MB", "≤ 5 MB")
    row("exposition, gzip (as Prometheus gets it)", "", f"{timings['gzip bytes'] / 1e6:.2f} MB")
    row("render CPU, once per pass (min of 3)", f"{MAIN['render_s']:.2f} s", f"{min(renders):.3f} s", "≤ 1 s")
    row("render CPU if rendered on every scrape", f"{MAIN['render_s']:.2f} s", f"{every_scrape_s:.3f} s")
    row("record time, all backends of a pass", "", f"{record_s:.3f} s")
    for label in ("Prometheus (OpenMetrics, gzip)", "plain text, no gzip"):
        xs = timings[label]
        med, q95 = statistics.median(xs) * 1e3, p95(xs) * 1e3
        row(f"scrape {label}, median / p95", "", f"{med:.1f} / {q95:.1f} ms", "p95 ≤ 50 ms")


def row(figure: str, main: object, lean: object, target: str = "") -> None:
    print(f"{figure:<46}{main!s:>24}{lean!s:>18}{target:>14}")


if __name__ == "__main__":
    main()
