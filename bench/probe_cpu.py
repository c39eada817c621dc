"""canaryd's CPU per probe against the floor of the same exchange, and where one probe's CPU goes.

A loopback server (``tests/harness/loopback.py``, in a child process so that its CPU is not counted) replays a
vLLM chat answer of 32 tokens with the top 5 alternatives each. In one run this measures, in ``--runs``
rounds that each take all three side by side (medians printed; the ratios are medians of each round's):

* the floor: a bare POST of the same request body to the same server, plus ``json.loads`` of the answer,
  with httpx (the client canaryd's transport is built on), and beside it with the standard library's
  ``http.client`` (what the client itself costs);
* the daemon path: `probe_backend` passes on one open store and backend (the step `run_pass` takes
  for each backend of a daemon cycle);
* the CLI path: `one_pass`, which ``canaryd check`` runs: suites, backends and store opened every time;
* one probe's phases, before (the per-probe calls a pass used to make: body built per request, baseline
  and calibration read per probe, a transaction per observation) and after (what a pass now calls).

``--before REF`` runs the same measurements on a git revision (in a temporary worktree) and prints them
beside these, its phases as the "before". The two trees then take turns, one round each in a process of
its own, so that a busy moment of the machine weighs on both (each round's ratios are to its own floor).

    .venv/bin/python bench/probe_cpu.py [--canaries 13] [--passes 30] [--runs 5] [--before REF]
"""

from __future__ import annotations

import argparse
import http.client
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
from canaryd.backends import make_backend, openai_request  # noqa: E402
from canaryd.backends import openai_compat as compat  # noqa: E402
from canaryd.backends import openai_wire as wire  # noqa: E402
from canaryd.canaries import load_suites  # noqa: E402
from canaryd.config import load_config  # noqa: E402
from canaryd.judge.compare import compare  # noqa: E402
from canaryd.probe.run import one_pass, plan, probe_backend  # noqa: E402
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
        top += [
            {"token": f" alt{i}_{j}", "logprob": -1.5 - j - i / 100, "bytes": None} for j in range(TOP - 1)
        ]
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
    from tests.harness.loopback import Loopback

    class Replay(Loopback):
        @staticmethod
        def _document(path: str) -> dict:
            return vllm_body() if path.endswith("/chat/completions") else Loopback._document(path)

    with Replay() as server:
        print(server.url, flush=True)
        sys.stdin.read()  # until the bench closes our stdin


def suite(n: int) -> str:
    return '[suite]\nname = "bench"\n' + "".join(
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--canaries", type=int, default=13, help="canaries per pass (the default suite has 13)")
    ap.add_argument("--passes", type=int, default=30, help="passes per run")
    ap.add_argument("--runs", type=int, default=5, help="runs per figure (medians are printed)")
    ap.add_argument("--before", metavar="REF", help="also measure this git revision, in a worktree")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve()
    log.configure("warning")
    if args.before:
        return report(*interleaved(args), args)
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        url = child.stdout.readline().strip()  # type: ignore[union-attr]
        work = Path(tempfile.mkdtemp(prefix="canaryd-probe-cpu-"))
        (work / "suite.toml").write_text(suite(args.canaries))
        (work / "canaryd.toml").write_text(CONFIG.format(base_url=f"{url}/ok/v1"))
        figures = measure(load_config(work / "canaryd.toml"), args)
    finally:
        child.stdin.close()  # type: ignore[union-attr]
        child.wait(10)
    if args.json:
        print(json.dumps(figures))
    else:
        report(figures, None, args)


def interleaved(args) -> tuple[dict, dict]:
    """This tree's figures and ``--before``'s (in a worktree): ``--runs`` rounds of one run each, the two
    trees taking turns; medians of the rounds."""
    tree = Path(tempfile.mkdtemp(prefix="canaryd-before-")) / "tree"
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(tree), args.before], check=True
    )
    try:
        (tree / "bench" / "probe_cpu.py").write_text(Path(__file__).read_text())
        flags = ["--canaries", str(args.canaries), "--passes", str(args.passes), "--runs", "1", "--json"]
        rounds: dict[Path, list[dict]] = {REPO: [], tree: []}
        for _ in range(args.runs):
            for root, done in rounds.items():
                out = subprocess.run(
                    [sys.executable, str(root / "bench" / "probe_cpu.py"), *flags],
                    env={**os.environ, "PYTHONPATH": str(root)},
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
                done.append(json.loads(out.splitlines()[-1]))
        return _medians(rounds[REPO]), _medians(rounds[tree])
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)


def _medians(rounds: list[dict]) -> dict:
    first = rounds[0]
    out = {key: statistics.median(r[key] for r in rounds) for key in ("floor", "daemon", "cli", "stdlib")}
    out["ratios"] = {key: statistics.median(r["ratios"][key] for r in rounds) for key in first["ratios"]}
    out["phases"] = {
        name: [statistics.median(r["phases"][name][i] for r in rounds) for i in range(len(figures))]
        for name, figures in first["phases"].items()
    }
    return out | {"canaries": first["canaries"]}


def measure(config, args) -> dict:
    """Floor, daemon and CLI figures, and one probe's phases: before (the per-probe calls a pass used
    to make, which every revision has) and, where this revision has them, after."""
    canaries = plan(config, load_suites([s.path for s in config.suites]))["replay"]
    n, runs, passes = len(canaries), args.runs, args.passes
    one_pass(config)  # baselines
    backend = make_backend(config.backend("replay"))
    store = Store(config.storage_url)
    prober = backend.prober
    canary = canaries[0]
    chat_url = f"{prober.cfg.base_url}/chat/completions"
    content = compat.wire_body(prober.request(canary))

    bare = httpx2.Client()  # the floor: the same bytes to the same server, and json.loads

    def floor_once() -> None:
        json.loads(bare.post(chat_url, content=content, headers=compat.JSON).content)

    url = httpx2.URL(chat_url)
    plain = http.client.HTTPConnection(url.host, url.port)

    def stdlib_once() -> None:
        plain.request("POST", url.raw_path.decode(), body=content, headers=compat.JSON)
        json.loads(plain.getresponse().read())

    def daemon_once() -> None:
        probe_backend(backend, canaries, store, config)

    floor_once(), daemon_once(), stdlib_once()
    rounds = []  # all four side by side in each round, so that a busy moment weighs on all of them
    for _ in range(runs):
        f, d = cpu(floor_once, passes * n), cpu(daemon_once, passes) / n
        c = cpu(lambda: one_pass(config), max(3, passes // 3)) / n
        rounds.append((f, d, c, cpu(stdlib_once, passes * n)))
    bare.close()
    plain.close()
    floor, daemon, cli, stdlib = (statistics.median(r[i] for r in rounds) for i in range(4))
    ratios = {
        key: statistics.median(r[i] / r[0] for r in rounds)
        for i, key in ((1, "daemon"), (2, "cli"), (3, "stdlib"))
    }

    # -- one probe, phase by phase ----------------------------------------------------------------
    k = passes * n
    obs = backend.probe(canary)
    reply = prober.exchange("POST", chat_url, content=content, headers=compat.JSON)
    run_id = store.start_run("replay")
    base = store.baseline("replay", canary.id)
    comparison = compare(base.observation, obs, correct=None, baseline_correct=base.correct)

    def request_before() -> None:
        body = {**openai_request.request_body(prober.cfg.model, canary), **prober.extra_params(canary)}
        openai_request.request_hash(body)
        prober.exchange("POST", chat_url, content=compat.wire_body(body), headers=compat.JSON)

    def parse() -> None:
        wire.parse_chat(wire.parse_json(reply.body))

    def judge() -> None:
        compare(base.observation, obs, correct=None, baseline_correct=base.correct)

    def read_before() -> None:
        store.baseline("replay", canary.id)
        store.calibration("replay", canary.id)

    def write_before() -> None:
        store.add_observation(run_id, obs, comparison, base.observation_id)

    phases = {
        "request (build, send, receive)": [cpu(request_before, k)],
        "parse (JSON, typed fields)": [cpu(parse, k)],
        "judge (compare with the baseline)": [cpu(judge, k)],
        "store read (baseline, calibration)": [cpu(read_before, k)],
        "store write (observation)": [cpu(write_before, k)],
    }
    if hasattr(store, "judging"):  # this revision has the cheap path

        def request_after() -> None:
            req = prober._prepared(canary)
            prober.exchange("POST", req.url, content=req.content, headers=compat.JSON)

        items = [(obs, comparison, base.observation_id)] * n
        phases["request (build, send, receive)"].append(cpu(request_after, k))
        phases["parse (JSON, typed fields)"].append(cpu(parse, k))
        phases["judge (compare with the baseline)"].append(cpu(judge, k))
        # one generation statement per pass, shared by its probes; one transaction per pass
        phases["store read (baseline, calibration)"].append(cpu(lambda: store.judging("replay"), passes) / n)
        phases["store write (observation)"].append(cpu(lambda: store.record(run_id, items, n), passes) / n)
    backend.close()
    store.close()
    figures = {"floor": floor, "daemon": daemon, "cli": cli, "stdlib": stdlib}
    return figures | {"ratios": ratios, "canaries": n, "phases": phases}


def report(now: dict, old: dict | None, args) -> None:
    ms = 1000

    def line(name: str, f: dict, key: str) -> str:
        return f"{f[key] * ms:7.3f} ms {f['ratios'].get(key, 1.0):5.1f}x"

    print(f"canaryd CPU per probe ({os.cpu_count()} cores; a vLLM chat answer of {TOKENS} tokens, top {TOP};")
    print(f"{now['canaries']} canaries a pass; medians of {args.runs} runs; the server in another process)")
    head = f"  {'':<44} {'now':>16}"
    print(head + (f"   {args.before:>16}" if old else ""))
    for name, key in (
        ("floor: bare POST + json.loads", "floor"),
        ("daemon path (probe_backend)", "daemon"),
        ("CLI check path (one_pass)", "cli"),
        ("bare POST + json.loads, http.client", "stdlib"),
    ):
        print(f"  {name:<44} {line(name, now, key)}" + (f"   {line(name, old, key)}" if old else ""))
    source = f"before: {args.before}" if old else "before: the per-probe calls"
    print(f"  one probe, by phase ({source}; after: now)")
    before_phases = (old or now)["phases"]
    total_b = total_a = 0.0
    for name, figures in now["phases"].items():
        b, a = before_phases[name][-1 if old else 0], figures[-1]  # what each revision's pass calls
        total_b, total_a = total_b + b, total_a + a
        print(f"    {name:<42} {b * ms:7.3f} ms -> {a * ms:7.3f} ms")
    print(f"    {'sum':<42} {total_b * ms:7.3f} ms -> {total_a * ms:7.3f} ms")


if __name__ == "__main__":
    main()
