"""Soak: `canaryd run` at a compressed interval against a flapping backend, for --minutes (default 30).

A real vLLM (CPU) server sits behind the tests' fault-injecting proxy, which alternates between healthy and
failing (503, hangs, cut bodies) every --flap seconds. With ``--scripted N`` the backend is instead the
scripted kind answering a generated suite of N canaries, whose answers change every few passes (drift,
then back): no server, so the daemon's own memory (store, caches, metrics) is what is measured at many
pairs. Every --sample seconds the daemon's resident memory, open file descriptors and scheduler counters
are read. Printed: RSS slope (least squares over the second half, after warm-up), fd growth, passes run vs
expected, passes skipped. Not a test: figures only.

    .venv/bin/python bench/soak.py [--minutes 30] [--interval 2] [--flap 20] [--scripted 1000]
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx2

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from canaryd.lab.tinymodel import build_tiny_model  # noqa: E402
from canaryd.lab.vllm_process import VLLMServer, free_port  # noqa: E402
from tests.harness.faultproxy import FaultProxy  # noqa: E402

CONFIG = """
state_dir = "state"
suites = ["{suite}"]
[daemon]
listen = "127.0.0.1:{metrics_port}"
[[schedules]]
name = "soak"
every = "{interval}s"
[[backends]]
name = "flappy"
kind = "vllm"
base_url = "{url}/v1"
model = "tiny"
timeout_s = 3
retries = 1
retry_backoff = "100ms"
breaker_failures = 5
breaker_cooldown = "10s"
"""


SCRIPTED = """
state_dir = "state"
suites = ["{suite}"]
[daemon]
listen = "127.0.0.1:{metrics_port}"
[[schedules]]
name = "soak"
every = "{interval}s"
[[backends]]
name = "scripted"
kind = "scripted"
latency_s = 0
[[backends.changes]]
at = 5
until = 8
logprob_shift = -0.05
"""


def scripted_suite(path: Path, n: int) -> Path:
    """A suite of ``n`` short chat canaries (the scripted kind answers each with its ``expect.answer``)."""
    lines = ['[suite]\nname = "soak"\n[defaults]\nmax_tokens = 8\n']
    for i in range(n):
        lines.append(
            f'[[canary]]\nid = "c{i}"\nmessages = [{{ role = "user", content = "Say {i}." }}]\n'
            f'expect = {{ regex = "^{i}$", answer = "{i}" }}\n'
        )
    path.write_text("".join(lines))
    return path


def proc_stat(pid: int) -> tuple[float, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kib = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))
    return rss_kib / 1024, len(os.listdir(f"/proc/{pid}/fd"))


def counter(text: str, name: str) -> float:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    n = len(points)
    if n < 2:
        return float("nan")
    mx, my = sum(t for t, _ in points) / n, sum(v for _, v in points) / n
    var = sum((t - mx) ** 2 for t, _ in points)
    return sum((t - mx) * (v - my) for t, v in points) / var * 3600 if var else float("nan")


def soak(args: argparse.Namespace, work: Path, config: str, metrics_port: int | str):
    """Run the daemon on ``config`` for --minutes, sampling it; returns (samples, elapsed, metrics, exit)."""
    (work / "canaryd.toml").write_text(config)
    daemon = subprocess.Popen(
        [sys.executable, "-m", "canaryd", "-c", str(work / "canaryd.toml"), "--log-level", "warning", "run"],
        stderr=(work / "canaryd.log").open("wb"),
    )
    samples: list[tuple[float, float, int]] = []
    t0 = time.monotonic()
    deadline = t0 + args.minutes * 60
    with httpx2.Client(timeout=10) as client:
        while time.monotonic() < deadline and daemon.poll() is None:
            time.sleep(args.sample)
            rss, fds = proc_stat(daemon.pid)
            samples.append((time.monotonic() - t0, rss, fds))
        text = client.get(f"http://127.0.0.1:{metrics_port}/metrics").text
    elapsed = time.monotonic() - t0
    daemon.terminate()
    return samples, elapsed, text, daemon.wait(120)


def report(args: argparse.Namespace, samples, elapsed: float, text: str, code: int) -> None:
    runs = counter(text, "canaryd_schedule_runs_total")
    missed = counter(text, "canaryd_schedule_missed_total")
    half = [(t, r) for t, r, _ in samples if t >= elapsed / 2]
    what = f"{args.scripted} scripted canaries" if args.scripted else f"flapping every {args.flap} s"
    print(f"canaryd soak: {elapsed / 60:.1f} min, a pass every {args.interval} s, {what}")
    print(f"  RSS first / last sample        {samples[0][1]:.1f} / {samples[-1][1]:.1f} MiB")
    print(f"  RSS slope (second half)        {slope_per_hour(half):+.2f} MiB/hour")
    print(
        f"  open fds first / max / last    {samples[0][2]} / {max(f for *_, f in samples)} / {samples[-1][2]}"
    )
    print(
        f"  passes run / expected          {runs:.0f} / {elapsed / args.interval:.0f} (skipped: {missed:.0f})"
    )
    print(f"  daemon exit code on SIGTERM    {code}")
    print(f"  logs: {args.work / 'canaryd.log'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--interval", type=int, default=2, help="seconds between passes")
    ap.add_argument("--flap", type=float, default=20, help="seconds between healthy and failing phases")
    ap.add_argument("--sample", type=float, default=15, help="seconds between samples")
    ap.add_argument("--scripted", type=int, metavar="N", help="a scripted backend with N canaries, no vLLM")
    args = ap.parse_args()
    args.work = work = Path(tempfile.mkdtemp(prefix="canaryd-soak-"))
    if args.scripted:
        port = free_port()
        suite = scripted_suite(work / "soak.toml", args.scripted)
        report(
            args,
            *soak(args, work, SCRIPTED.format(suite=suite, metrics_port=port, interval=args.interval), port),
        )
        return

    model = build_tiny_model(REPO / ".cache" / "test-models" / "random-seed0", seed=0)
    with VLLMServer(model, extra_args=["--enforce-eager"], log_path=work / "vllm.log") as server:
        proxy = FaultProxy(server.root_url, hang_s=5)
        port = free_port()
        config = CONFIG.format(
            suite=REPO / "canaries" / "default.toml", metrics_port=port, interval=args.interval, url=proxy.url
        )
        stop = threading.Event()

        def flap() -> None:
            for mode in itertools.cycle(["pass", "503", "pass", "hang", "pass", "truncate"]):
                proxy.mode = mode
                if stop.wait(args.flap):
                    return

        threading.Thread(target=flap, daemon=True).start()
        result = soak(args, work, config, port)
        stop.set()
        proxy.stop()
    report(args, *result)


if __name__ == "__main__":
    main()
