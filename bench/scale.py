"""What one daemon carries: `canaryd run` on many vLLM-like backends whose answers take 200 ms.

A few loopback servers (asyncio, in child processes, so their CPU is not the daemon's) answer like vLLM:
the documents of ``tests/harness/loopback.py`` (``GET …/models``, ``…/version``, ``…/metrics``), and every
chat completion after ``--delay`` seconds. ``--backends`` backend entries (spread over ``--servers``
servers) × ``--canaries`` canaries, one schedule every ``--interval`` seconds, SQLite, one real daemon
process (`canaryd run`) with its default ``[daemon] max_in_flight`` unless ``--cap``. The script reads the
daemon's ``/metrics`` each second and prints every pass (duration against the interval; an overrun says
so, with the backends the daemon's warning named), then the daemon's RSS and CPU per probe over the
passes after the first (the first takes baselines and first contact), next to a small config's (``--small``
backends, same canaries and delay) measured the same way in the same run.

    .venv/bin/python bench/scale.py                 # 1,000 backends × 5 canaries at 60 s (about 6 min)
    .venv/bin/python bench/scale.py --quick         # 200 backends, 3 passes at 20 s (about 2 min)
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

from tests.harness.loopback import Loopback, chat_body  # noqa: E402
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
    work: Path, ports: list[int], backends: int, canaries: int, interval: int, cap: int | None
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
    daemon = f'[daemon]\nlisten = "127.0.0.1:{free_port()}"\n' + (f"max_in_flight = {cap}\n" if cap else "")
    path = work / "canaryd.toml"
    path.write_text(
        f'state_dir = "state"\nsuites = ["suite.toml"]\n{entries}{daemon}'
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


def run(label: str, ports: list[int], backends: int, args: argparse.Namespace) -> dict:
    """One daemon on ``backends`` backends for ``args.passes`` passes: each pass's figures, RSS, CPU."""
    work = Path(tempfile.mkdtemp(prefix="canaryd-scale-"))
    path = config(work, ports, backends, args.canaries, args.interval, args.cap)
    listen = re.search(r'listen = "([^"]+)"', path.read_text()).group(1)  # type: ignore[union-attr]
    log = (work / "daemon.log").open("w")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    daemon = subprocess.Popen(
        [sys.executable, "-m", "canaryd", "-c", str(path), "run"],
        cwd=work,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    print(
        f"\n{label}: {backends} backends x {args.canaries} canaries every {args.interval} s, "
        f"{args.delay * 1000:.0f} ms per answer"
    )
    passes, last_done, t0 = [], None, time.monotonic()
    try:
        while len(passes) < args.passes:
            time.sleep(1)
            if daemon.poll() is not None:
                raise SystemExit(f"the daemon exited {daemon.returncode}: see {work / 'daemon.log'}")
            try:
                text = urllib.request.urlopen(f"http://{listen}/metrics", timeout=5).read().decode()
            except OSError:
                continue
            done = metric(text, "canaryd_schedule_last_run_timestamp_seconds")
            if done is None or done == last_done:
                continue
            last_done = done
            cpu, rss = sample(daemon.pid)
            took = metric(text, "canaryd_schedule_last_pass_duration_seconds") or 0.0
            overruns = metric(text, "canaryd_schedule_overruns_total") or 0.0
            passes.append({"duration_s": took, "cpu_s": cpu, "rss_mib": rss, "overruns": overruns})
            late = ""
            if overruns > (passes[-2]["overruns"] if len(passes) > 1 else 0):
                warnings = [
                    json.loads(line)
                    for line in (work / "daemon.log").read_text().splitlines()
                    if '"pass_overran"' in line
                ]
                w = warnings[-1] if warnings else {}
                late = f"  OVERRUN: {w.get('late', '?')} late, e.g. {', '.join(w.get('backends', [])[:5])}"
            print(
                f"  pass {len(passes)}: {took:7.1f} s of {args.interval} s, RSS {rss:6.1f} MiB, "
                f"CPU so far {cpu:6.1f} s{late}",
                flush=True,
            )
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)
        log.close()
    steady = passes[1:] or passes
    probes = backends * args.canaries * len(steady)
    cpu = passes[-1]["cpu_s"] - (passes[0]["cpu_s"] if len(passes) > 1 else 0.0)
    return {
        "label": label,
        "backends": backends,
        "overran": sum(
            1 for i, p in enumerate(passes) if p["overruns"] > (passes[i - 1]["overruns"] if i else 0)
        ),
        "passes": len(passes),
        "longest_s": max(p["duration_s"] for p in steady),
        "rss_mib": passes[-1]["rss_mib"],
        "cpu_ms_per_probe": cpu / probes * 1000,
        "wall_s": time.monotonic() - t0,
    }


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
    ap.add_argument("--quick", action="store_true", help="200 backends, 3 passes at 20 s")
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return asyncio.run(_serve(args.serve, args.delay))
    if args.quick:
        args.backends, args.passes, args.interval = 200, 3, 20
    procs, ports = servers(args.servers, args.delay)
    try:
        results = [run("small", ports, args.small, args), run("large", ports, args.backends, args)]
    finally:
        for p in procs:
            p.kill()
    print("\none daemon, side by side (CPU per probe over the passes after the first)")
    print(
        f"{'config':<8}{'backends':>9}{'probes/pass':>12}{'overran':>10}{'longest pass':>14}"
        f"{'RSS MiB':>9}{'CPU ms/probe':>14}"
    )
    for r in results:
        print(
            f"{r['label']:<8}{r['backends']:>9}{r['backends'] * args.canaries:>12}"
            f"{r['overran']:>6} of {r['passes']}{r['longest_s']:>12.1f} s{r['rss_mib']:>9.1f}"
            f"{r['cpu_ms_per_probe']:>14.2f}"
        )


if __name__ == "__main__":
    main()
