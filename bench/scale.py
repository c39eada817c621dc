"""What one daemon carries, and what three share: `canaryd run` on many vLLM-like backends whose answers
take 200 ms.

A few loopback servers (asyncio, in child processes, so their CPU is not the daemon's) answer like vLLM:
the documents of ``tests/harness/loopback.py`` (``GET …/models``, ``…/version``, ``…/metrics``), and every
chat completion after ``--delay`` seconds. ``--backends`` backend entries (spread over ``--servers``
servers) × ``--canaries`` canaries, one schedule every ``--interval`` seconds, real daemon processes
(`canaryd run`) with their default ``[daemon] max_in_flight`` unless ``--cap``: a small config (``--small``
backends, one daemon, SQLite), then the large one with each daemon count of ``--daemons`` (one on SQLite
when ``--sqlite``; otherwise all on one real PostgreSQL database, sharing the backends). The script reads
each daemon's ``/metrics`` every ``--scrape`` seconds (15, as Prometheus would: each read after a pass
renders the exposition) and prints every pass (duration against the interval; an overrun
says so, with the backends the daemon's warning named), then per daemon: its share of the weighted work,
its RSS and its CPU per probe over the passes after the first (the first takes baselines and first
contact, and a fleet's shares settle in it), side by side. The PostgreSQL rows share one database, so a
later row starts with the first one's baselines (its daemons all start at once: the first claim takes every
backend, and the others take their shares at its next pass).

    .venv/bin/python bench/scale.py                 # 1,000 backends × 5 canaries at 60 s, 1 and 3 daemons
    .venv/bin/python bench/scale.py --quick         # 200 backends, 3 passes at 20 s
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sqlalchemy import create_engine, text  # noqa: E402

from canaryd.store.leases import spacing  # noqa: E402
from tests.harness.loopback import Loopback, chat_body  # noqa: E402
from tests.harness.postgres import PostgresServer  # noqa: E402
from tests.harness.scripted_lab import free_port  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


# -- the servers ----------------------------------------------------------------------------------------
async def _serve(port: int, delay: float) -> None:
    body = json.dumps(chat_body()).encode()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line, *fields = head.decode("latin-1").split("\r\n")
                path = line.split(" ")[1]
                length = next(
                    (int(f.split(":")[1]) for f in fields if f.lower().startswith("content-length")), 0
                )
                await reader.readexactly(length)
                if path.endswith("completions"):
                    await asyncio.sleep(delay)
                    out = body
                else:
                    out = json.dumps(Loopback._document(path)).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                    % len(out)
                    + out
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=4096)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


def servers(n: int, delay: float) -> tuple[list[subprocess.Popen], list[int]]:
    ports = [free_port() for _ in range(n)]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--serve", str(p), "--delay", str(delay)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for p in ports
    ]
    for p in procs:
        p.stdout.readline()  # type: ignore[union-attr]
    return procs, ports


# -- one daemon -----------------------------------------------------------------------------------------
def config(
    work: Path,
    ports: list[int],
    backends: int,
    canaries: int,
    interval: int,
    cap: int | None,
    url: str | None = None,
    instance: str = "solo",
) -> Path:
    suite = '[suite]\nname = "scale"\n' + "".join(
        f'[[canary]]\nid = "c{i}"\nmessages = [{{ role = "user", content = "Say {i}." }}]\n'
        for i in range(canaries)
    )
    (work / "suite.toml").write_text(suite)
    entries = "".join(
        f'[[backends]]\nname = "b{i:04d}"\nkind = "vllm"\n'
        f'base_url = "http://127.0.0.1:{ports[i % len(ports)]}/v1"\nmodel = "m"\n'
        for i in range(backends)
    )
    daemon = f'[daemon]\nlisten = "127.0.0.1:{free_port()}"\ninstance = "{instance}"\n'
    daemon += f"max_in_flight = {cap}\n" if cap else ""
    storage = f'[storage]\nurl = "{url}"\n' if url else ""
    path = work / f"{instance}.toml"
    path.write_text(
        f'state_dir = "state-{instance}"\nsuites = ["suite.toml"]\n{entries}{daemon}{storage}'
        f'[[schedules]]\nname = "s"\nevery = "{interval}s"\n'
    )
    return path


def sample(pid: int) -> tuple[float, float]:
    """(CPU seconds, RSS MiB) of the process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / TICKS
    rss = next(
        int(line.split()[1])
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if line.startswith("VmRSS")
    )
    return cpu, rss / 1024


def metric(text: str, name: str) -> float | None:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


def total(text: str, name: str) -> float:
    """The sum of a metric's series."""
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))


class Watched:
    """One daemon process of a run, and what its ``/metrics`` said at the end of each of its passes."""

    def __init__(self, work: Path, path: Path) -> None:
        self.name = path.stem
        self.listen = re.search(r'listen = "([^"]+)"', path.read_text()).group(1)  # type: ignore[union-attr]
        self.log_path = work / f"{self.name}.log"
        log = self.log_path.open("w")
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "canaryd", "-c", str(path), "run"],
            cwd=work,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        self.passes: list[dict] = []
        self.shares: list[tuple[float, float]] = []  # (monotonic time, its share of the weighted work)
        self.last_done: float | None = None

    def poll(self, interval: int) -> None:
        """Record a pass that ended since the last call, and print it."""
        if self.proc.poll() is not None:
            raise SystemExit(f"{self.name} exited {self.proc.returncode}: see {self.log_path}")
        try:
            text = urllib.request.urlopen(f"http://{self.listen}/metrics", timeout=5).read().decode()
        except OSError:
            return
        share = metric(text, "canaryd_fleet_weight_share")
        if share is not None:  # takeover and phase passes move it between regular passes
            self.shares.append((time.monotonic(), share))
        done = metric(text, "canaryd_schedule_last_run_timestamp_seconds")
        if done is None or done == self.last_done:
            return
        self.last_done = done
        cpu, rss = sample(self.proc.pid)
        took = metric(text, "canaryd_schedule_last_pass_duration_seconds") or 0.0
        overruns = metric(text, "canaryd_schedule_overruns_total") or 0.0
        self.passes.append(
            {
                "duration_s": took,
                "cpu_s": cpu,
                "rss_mib": rss,
                "overruns": overruns,
                "probes": total(text, "canaryd_backend_probes_total"),
                "share": metric(text, "canaryd_fleet_weight_share"),
                "held": metric(text, "canaryd_fleet_backends_held"),
            }
        )
        late = ""
        if overruns > (self.passes[-2]["overruns"] if len(self.passes) > 1 else 0):
            warnings = [
                json.loads(line)
                for line in self.log_path.read_text().splitlines()
                if '"pass_overran"' in line
            ]
            w = warnings[-1] if warnings else {}
            late = f"  OVERRUN: {w.get('late', '?')} late, e.g. {', '.join(w.get('backends', [])[:5])}"
        share = self.passes[-1]["share"]
        print(
            f"  {self.name} pass {len(self.passes)}: {took:7.1f} s of {interval} s, RSS {rss:6.1f} MiB, "
            f"CPU so far {cpu:6.1f} s" + (f", share {share:.1%}" if share is not None else "") + late,
            flush=True,
        )

    def figures(self) -> dict:
        passes = self.passes
        steady = passes[1:] or passes
        first = passes[0] if len(passes) > 1 else {"cpu_s": 0.0, "probes": 0.0}
        probes = passes[-1]["probes"] - first["probes"]
        return {
            "daemon": self.name,
            "overran": sum(
                1 for i, p in enumerate(passes) if p["overruns"] > (passes[i - 1]["overruns"] if i else 0)
            ),
            "passes": len(passes),
            "longest_s": max(p["duration_s"] for p in steady),
            "rss_mib": passes[-1]["rss_mib"],
            "rss_first_mib": passes[0]["rss_mib"],
            "cpu_ms_per_probe": (passes[-1]["cpu_s"] - first["cpu_s"]) / max(probes, 1) * 1000,
            "share": self.shares[-1][1] if self.shares else passes[-1]["share"],
        }


def run(
    label: str,
    ports: list[int],
    backends: int,
    args: argparse.Namespace,
    daemons: int = 1,
    url: str | None = None,
) -> list[dict]:
    """``daemons`` daemons (on the database ``url``; None: one on SQLite) on ``backends`` backends, until
    each has done ``args.passes`` passes: each one's figures."""
    work = Path(tempfile.mkdtemp(prefix="canaryd-scale-"))
    names = ["solo"] if url is None else [f"d{i + 1}" for i in range(daemons)]
    paths = [config(work, ports, backends, args.canaries, args.interval, args.cap, url, n) for n in names]
    print(
        f"\n{label}: {backends} backends x {args.canaries} canaries every {args.interval} s, "
        f"{args.delay * 1000:.0f} ms per answer, {len(names)} daemon(s) on "
        + ("PostgreSQL" if url else "SQLite")
    )
    since = time.time()
    watched = [Watched(work, p) for p in paths]
    t0 = time.monotonic()
    shown = t0
    try:
        while any(len(w.passes) < args.passes for w in watched):
            time.sleep(args.scrape)
            for w in watched:
                w.poll(args.interval)
            if url and time.monotonic() - shown >= args.interval / 2:  # the shares, every half interval
                shown = time.monotonic()
                now = ", ".join(f"{w.name} {w.shares[-1][1]:.1%}" for w in watched if w.shares)
                print(f"  {shown - t0:6.0f} s: shares {now}", flush=True)
    finally:
        for w in watched:
            w.proc.send_signal(signal.SIGTERM)
        for w in watched:
            w.proc.wait(60)
    wall = time.monotonic() - t0
    close, gap, why = spacings(url, args.interval, since, since + wall / 2) if url else (None, None, "")
    if why:
        print(f"  longest gap in the second half: {gap:.1f} s, {why}")
    settled = balanced(watched, t0) if url and daemons > 1 else None
    if settled is not None:
        print(f"  shares within {1 / daemons:.0%} ± 5 points from {settled:.0f} s after the start on")
    return [
        dict(w.figures(), label=label, backends=backends, wall_s=wall, doubles=close, gap_s=gap)
        for w in watched
    ]


def balanced(watched: list[Watched], t0: float) -> float | None:
    """Seconds from the start after which every daemon's share stayed within an even share ± 5 points (None:
    not by the end)."""
    even = 1 / len(watched)
    times = sorted({t for w in watched for t, _ in w.shares})
    since = None
    for t in times:
        now = [next((v for u, v in reversed(w.shares) if u <= t), None) for w in watched]
        ok = all(v is not None and abs(v - even) <= 0.05 for v in now)
        since = (since if since is not None else t) if ok else None
    return None if since is None else since - t0


def spacings(url: str, interval: float, since: float, later: float) -> tuple[tuple[int, int], float, str]:
    """From the ``run`` table, since ``since`` (Unix time): how many times a backend was probed again sooner
    than the lease allows (`canaryd.store.leases.spacing`, measured here between the runs' own starts,
    which a loaded machine puts a little later than the lease's stamps) and sooner than half an interval
    (twice in one interval); and the longest time between two probes of a backend in the second half of
    the run (``later`` on: the first pass's first contact is over), with its backend and which daemon made
    each of its two probes when (seconds from ``since``: their logs say which passes they were)."""
    engine = create_engine(url)
    with engine.connect() as c:
        sql = "SELECT backend, instance, extract(epoch FROM started_at) FROM run ORDER BY started_at"
        rows = [(b, i, float(t)) for b, i, t in c.execute(text(sql)) if float(t) >= since]
    engine.dispose()
    last: dict[str, tuple[str, float]] = {}
    close, half, gap, worst = 0, 0, 0.0, ("", ("", 0.0), ("", 0.0))
    for b, inst, t in rows:
        if b in last:
            was = last[b][1]
            close += t - was < spacing(interval)
            half += t - was < interval / 2
            if was >= later and t - was > gap:
                gap, worst = t - was, (b, last[b], (inst, t))
        last[b] = (inst, t)
    b, (i0, t0), (i1, t1) = worst
    why = f"{b}: {i0} at {t0 - since:.1f} s -> {i1} at {t1 - since:.1f} s from the start" if b else ""
    return (close, half), gap, why


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", type=int, default=1000)
    ap.add_argument("--canaries", type=int, default=5)
    ap.add_argument("--interval", type=int, default=60)
    ap.add_argument("--delay", type=float, default=0.2, help="seconds each chat completion takes")
    ap.add_argument("--servers", type=int, default=4)
    ap.add_argument("--passes", type=int, default=4, help="passes per daemon (the first takes baselines)")
    ap.add_argument("--small", type=int, default=10, help="backends of the small config beside it")
    ap.add_argument("--cap", type=int, help="[daemon] max_in_flight (default: the daemon's)")
    ap.add_argument("--daemons", default="1,3", help="daemon counts of the large config, comma-separated")
    ap.add_argument("--sqlite", action="store_true", help="a one-daemon large row on SQLite too")
    ap.add_argument("--quick", action="store_true", help="200 backends, 3 passes at 20 s")
    ap.add_argument("--scrape", type=float, default=15.0, help="seconds between two reads of /metrics")
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return asyncio.run(_serve(args.serve, args.delay))
    if args.quick:
        args.backends, args.passes, args.interval = 200, 3, 20
    procs, ports = servers(args.servers, args.delay)
    results: list[dict] = []
    try:
        if args.small:
            results += run("small", ports, args.small, args)
        if args.sqlite:
            results += run("large", ports, args.backends, args)
        with PostgresServer() as pg:  # one database: a later row starts with the baselines of the first
            url = pg.create_database("scale")
            for n in (int(n) for n in args.daemons.split(",")):
                results += run(f"large x{n}", ports, args.backends, args, n, url)
    finally:
        for p in procs:
            p.kill()
    print("\nside by side (CPU per probe over the passes after the first; RSS after the first pass -> last;")
    print("doubles: probes sooner than the lease's spacing / than half an interval; longest gap: 2nd half)")
    print(
        f"{'config':<10}{'daemon':>7}{'backends':>9}{'probes/pass':>12}{'overran':>10}{'longest pass':>14}"
        f"{'share':>8}{'RSS MiB':>16}{'CPU ms/probe':>14}{'doubles':>12}{'longest gap':>13}"
    )
    for r in results:
        share = f"{r['share']:.1%}" if r["share"] is not None else "-"
        print(
            f"{r['label']:<10}{r['daemon']:>7}{r['backends']:>9}{r['backends'] * args.canaries:>12}"
            f"{r['overran']:>6} of {r['passes']}{r['longest_s']:>12.1f} s{share:>8}"
            f"{r['rss_first_mib']:>8.1f} ->{r['rss_mib']:>6.1f}{r['cpu_ms_per_probe']:>14.2f}"
            + (f"{'{} / {}'.format(*r['doubles']):>12}{r['gap_s']:>11.1f} s" if r["doubles"] else "")
        )


if __name__ == "__main__":
    main()
