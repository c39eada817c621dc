"""Write throughput of the history: observations per second through `Store.add_observation`.

The same synthetic observations (a default-suite-like chat request, ``--tokens`` tokens with ``--top``
alternatives, a 3-field stack; ``--distinct`` payloads cycled, so most writes re-use stored content) go
into SQLite (WAL, synchronous=NORMAL: what canaryd uses) and into a PostgreSQL server this script starts
itself (initdb into a temporary directory, as the test harness does; PostgreSQL's binaries are needed),
once with its durable defaults and once with ``synchronous_commit=off`` (the durability SQLite's
synchronous=NORMAL gives: a crash can lose the last commits, never corrupt). One writer, one transaction
per observation, as the daemon writes.

    .venv/bin/python bench/db_throughput.py [-n 2000] [--distinct 4]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from canaryd import log
from canaryd.judge.compare import Comparison, compare
from canaryd.observation import Observation, TokenLogprob
from canaryd.store import Store
from tests.harness.postgres import PostgresServer

REQUEST = {
    "model": "my-model",
    "messages": [{"role": "user", "content": "What is 17 + 25? Answer with the number only."}],
    "temperature": 0.0,
    "top_p": 1.0,
    "max_tokens": 16,
    "seed": 0,
    "logprobs": True,
    "top_logprobs": 5,
}
STACK = {"backend.kind": "vllm", "vllm.version": "0.32.0", "response.system_fingerprint": "fp-1"}


def observations(n: int, distinct: int, tokens: int, top: int) -> list[tuple[Observation, Comparison]]:
    """n observations cycling through ``distinct`` payloads, each judged against the first."""
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    out: list[tuple[Observation, Comparison]] = []
    for i in range(n):
        v = i % distinct
        o = Observation("local", "arith-add", "default", t0 + timedelta(minutes=5 * i), REQUEST, "req-1")
        o.text, o.finish_reason, o.system_fingerprint = f"4{v}", "stop", "fp-1"
        o.tokens = [
            TokenLogprob(
                f"t{k}",
                -0.1 * (k + 1) - v / 7,
                1000 + k,
                (52, 50),
                tuple((f"a{j}", -1.0 - j - v / 11) for j in range(top)),
            )
            for k in range(tokens)
        ]
        o.prompt_tokens, o.completion_tokens, o.latency_s = 21, tokens, 0.05
        o.stack = STACK
        out.append((o, compare(out[0][0] if out else None, o, correct=True)))
    return out


def throughput(url: str, work: list[tuple[Observation, Comparison]]) -> float:
    store = Store(url, instance="bench")
    run = store.start_run("local")
    first = store.add_observation(run, *work[0], None)
    t = time.perf_counter()
    for obs, comparison in work[1:]:
        store.add_observation(run, obs, comparison, first)
    elapsed = time.perf_counter() - t
    store.close()
    return (len(work) - 1) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=2000)
    ap.add_argument("--distinct", type=int, default=4, help="distinct payloads, cycled")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--top", type=int, default=5)
    args = ap.parse_args()
    log.configure("warning")
    work = observations(args.n, args.distinct, args.tokens, args.top)
    rows = []
    with tempfile.TemporaryDirectory(prefix="canaryd-bench-") as tmp:
        rows.append(("SQLite (WAL, synchronous=NORMAL)", throughput(f"sqlite:///{tmp}/bench.db", work)))
    for label, settings in (
        ("PostgreSQL (defaults: fsync, synchronous_commit=on)", {"fsync": "on"}),
        ("PostgreSQL (synchronous_commit=off)", {"fsync": "on", "synchronous_commit": "off"}),
    ):
        with PostgresServer(settings=settings) as pg:
            rows.append((f"{label}, {pg.bindir.parent.name}", throughput(pg.create_database("bench"), work)))
    width = max(len(r[0]) for r in rows)
    print(f"{args.n} observations, {args.distinct} distinct payloads, {args.tokens} tokens x top-{args.top}")
    print(f"{'database':<{width}}  {'obs/s':>8}  {'ms/obs':>7}")
    for label, rate in rows:
        print(f"{label:<{width}}  {rate:>8.0f}  {1000 / rate:>7.2f}")


if __name__ == "__main__":
    main()
