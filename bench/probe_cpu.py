"""canaryd's CPU per probe against the floor of the same exchange, and where one probe's CPU goes.

A loopback server (``tests/unit/loopback.py``, in a child process so that its CPU is not counted) replays a
vLLM chat answer of 32 tokens with the top 5 alternatives each. In one run this measures, as medians of
``--runs`` runs:

* the floor: a bare POST of the same request body to the same server, plus ``json.loads`` of the answer;
* the daemon path: `probe_backend` passes on one open store and backend (what each daemon cycle does);
* the CLI path: `run_pass`, which ``canaryd check`` runs: suites, backends and store opened every time;
* one probe's phases, before (the uncached calls: body built per request, baseline and calibration read
  per probe, a transaction per observation) and after (what a pass now calls).

    .venv/bin/python bench/probe_cpu.py [--canaries 8] [--passes 30] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx2

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from canaryd import log  # noqa: E402
from canaryd.backends import make_backend  # noqa: E402
from canaryd.backends import openai_compat as compat  # noqa: E402
from canaryd.backends import openai_wire as wire  # noqa: E402
from canaryd.canaries import load_suites  # noqa: E402
from canaryd.config import load_config  # noqa: E402
from canaryd.probe.run import plan, probe_backend, run_pass  # noqa: E402
from canaryd.probe.shapes import shape_of  # noqa: E402
from canaryd.store import Store  # noqa: E402

TOKENS, TOP = 32, 5
CONFIG = """
state_dir = "state"
suites = ["suite.toml"]
[[backends]]
name = "replay"
kind = "vllm"
base_url = "{base_url}"
model = "m"
concurrency = 4
"""


def vllm_body() -> dict:
    """A vLLM chat completion as ``return_token_ids`` and ``top_logprobs = 5`` make it: 32 tokens."""
    words = [f" w{i}" for i in range(TOKENS)]
    content = []
    for i, w in enumerate(words):
        top = [{"token": w, "logprob": -0.0123 * i, "bytes": list(w.encode())}]
        top += [{"token": f" alt{i}_{j}", "logprob": -1.5 - j - i / 100, "bytes": None} for j in range(TOP - 1)]
        content.append({"token": w, "logprob": -0.0123 * i, "bytes": list(w.encode()), "top_logprobs": top})
    return {
        "id": "chatcmpl-9f1c2d7e0b3a4e6f8a1b2c3d4e5f6a7b",
        "object": "chat.completion",
        "created": 1764800000,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "".join(words), "tool_calls": []},
                "logprobs": {"content": content},
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": [1000 + i for i in range(TOKENS)],
            }
        ],
        "usage": {"prompt_tokens": 21, "total_tokens": 21 + TOKENS, "completion_tokens": TOKENS},
        "prompt_logprobs": None,
        "prompt_token_ids": list(range(21)),
        "kv_transfer_params": None,
    }


def serve() -> None:
    """The child process: the loopback server answering every chat request with `vllm_body`."""
    from tests.unit.loopback import Loopback

    class Replay(Loopback):
        @staticmethod
        def _document(path: str) -> dict:
            return vllm_body() if path.endswith("/chat/completions") else Loopback._document(path)

    with Replay() as server:
        print(server.url, flush=True)
        sys.stdin.read()  # until the bench closes our stdin


def suite(n: int) -> str:
    return "[suite]\nname = \"bench\"\n" + "".join(
        f'[[canary]]\nid = "c{i}"\nmessages = [{{ role = "user", content = "Count to {i}." }}]\n'
        f"decoding = {{ max_tokens = {TOKENS}, top_logprobs = {TOP} }}\n"
        for i in range(n)
    )


def cpu(fn: Callable[[], object], n: int) -> float:
    """CPU seconds of this process per call of ``fn``, over ``n`` calls."""
    c0 = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - c0) / n


def median_of(runs: int, fn: Callable[[], float]) -> float:
    return statistics.median(fn() for _ in range(runs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--canaries", type=int, default=8, help="canaries per pass")
    ap.add_argument("--passes", type=int, default=30, help="passes per run")
    ap.add_argument("--runs", type=int, default=5, help="runs per figure (medians are printed)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve()
    log.configure("warning")
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        url = child.stdout.readline().strip()  # type: ignore[union-attr]
        work = Path(tempfile.mkdtemp(prefix="canaryd-probe-cpu-"))
        (work / "suite.toml").write_text(suite(args.canaries))
        (work / "canaryd.toml").write_text(CONFIG.format(base_url=f"{url}/ok/v1"))
        report(load_config(work / "canaryd.toml"), args)
    finally:
        child.stdin.close()  # type: ignore[union-attr]
        child.wait(10)


def report(config, args) -> None:
    canaries = plan(config, load_suites([s.path for s in config.suites]))["replay"]
    n, runs, passes = len(canaries), args.runs, args.passes
    run_pass(config)  # baselines
    backend = make_backend(config.backend("replay"))
    store = Store(config.storage_url)
    prober = backend.prober
    canary = canaries[0]
    prepared = prober._prepared(canary)

    with httpx2.Client() as bare:  # the floor: the same bytes to the same server, and json.loads

        def floor_once() -> None:
            json.loads(bare.post(prepared.url, content=prepared.content, headers=compat.JSON).content)

        floor_once()
        floor = median_of(runs, lambda: cpu(floor_once, passes * n))

    def daemon_once() -> None:
        probe_backend(backend, canaries, store, config)

    daemon_once()
    daemon = median_of(runs, lambda: cpu(daemon_once, passes) / n)
    cli = median_of(runs, lambda: cpu(lambda: run_pass(config), max(3, passes // 3)) / n)

    # -- one probe, phase by phase ----------------------------------------------------------------
    k = passes * n
    obs = backend.probe(canary)
    reply = prober.exchange("POST", prepared.url, content=prepared.content, headers=compat.JSON)
    shape = shape_of(canary)
    run_id = store.start_run("replay")

    def request_before() -> None:
        body = {**wire.request_body(prober.cfg.model, canary), **prober.extra_params(canary)}
        wire.request_hash(body)
        prober.exchange("POST", prepared.url, content=compat.wire_body(body), headers=compat.JSON)

    def request_after() -> None:
        req = prober._prepared(canary)
        prober.exchange("POST", req.url, content=req.content, headers=compat.JSON)

    def parse() -> None:
        wire.parse_chat(wire.parse_json(reply.body))

    judged = shape.judge(store.judging("replay"), config.compare, canary, [obs])[0]

    def judge() -> None:
        shape.judge(reads, config.compare, canary, [obs])

    def read_before() -> None:
        store.baseline("replay", canary.id)
        store.calibration("replay", canary.id)

    def read_after() -> None:  # one generation statement per pass, shared by its probes
        store.judging("replay")

    def write_before() -> None:
        store.add_observation(run_id, obs, judged.comparison, judged.baseline_id)

    items = [(obs, judged.comparison, judged.baseline_id)] * n

    def write_after() -> None:  # one transaction per pass
        store.record(run_id, items, n)

    reads = store.judging("replay")
    phases = [
        ("request (build, send, receive)", cpu(request_before, k), cpu(request_after, k)),
        ("parse (JSON, typed fields)", cpu(parse, k), cpu(parse, k)),
        ("judge (compare with the baseline)", cpu(judge, k), cpu(judge, k)),
        ("store read (baseline, calibration)", cpu(read_before, k), cpu(read_after, passes) / n),
        ("store write (observation)", cpu(write_before, k), cpu(write_after, passes) / n),
    ]
    backend.close()
    store.close()

    ms = 1000
    print(f"canaryd probe CPU ({os.cpu_count()} cores; {TOKENS} tokens, top {TOP}; {n} canaries per pass;")
    print(f"medians of {runs} runs; loopback replay server in another process)")
    print(f"  {'floor: bare POST + json.loads':<44} {floor * ms:7.3f} ms")
    print(f"  {'daemon path (probe_backend), per probe':<44} {daemon * ms:7.3f} ms  {daemon / floor:5.1f}x floor")
    print(f"  {'CLI check path (run_pass), per probe':<44} {cli * ms:7.3f} ms  {cli / floor:5.1f}x floor")
    print(f"  one probe, by phase{'':<24} {'before':>7}    {'after':>7}")
    for name, before, after in phases:
        print(f"    {name:<40} {before * ms:7.3f} ms {after * ms:7.3f} ms")
    total_b, total_a = sum(p[1] for p in phases), sum(p[2] for p in phases)
    print(f"    {'sum':<40} {total_b * ms:7.3f} ms {total_a * ms:7.3f} ms")


if __name__ == "__main__":
    main()
