"""Storage per observation: does the history grow with change, not with time?

Writes synthetic observations through the real `Store` on SQLite and prints how many bytes the database
grows by for N identical observations (what a stable stack produces every 5 minutes) and for N distinct
ones (different text and logprobs each time). Target: identical < 5 % of distinct. A third figure adds
the per-request headers a hosted API sends (request id, rate-limit counters), which cannot be shared; a
fourth, the evidence of a calibrated latency, which differs on every probe (it is kept on the probe's
event, so the identical answers still share one outcome).

    .venv/bin/python bench/storage_bench.py [-n 1000] [--tokens 16] [--top 5]

Synthetic observations look like the default suite's: a chat request with every sampling parameter,
``--tokens`` generated tokens (the suite's ``max_tokens``) each with ``--top`` alternatives, float64
logprobs at full precision, vLLM-style token names and a 24-field vLLM stack.
"""

from __future__ import annotations

import argparse
import math
import random
import sqlite3
import sys
import tempfile
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from canaryd.judge.compare import compare
from canaryd.judge.signals import SignalFit
from canaryd.observation import Observation, TokenLogprob
from canaryd.store import Store

REQUEST = {
    "model": "my-model",
    "messages": [{"role": "user", "content": "What is 17 + 25? Answer with the number only."}],
    "temperature": 0.0,
    "top_p": 1.0,
    "max_tokens": 16,
    "n": 1,
    "seed": 0,
    "logprobs": True,
    "top_logprobs": 5,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "return_token_ids": True,
    "return_tokens_as_token_ids": True,
}
STACK = {
    "backend.kind": "vllm",
    "request.model": "my-model",
    "vllm.version": "0.32.0",
    "models.served": "my-model",
    "models.root": "/srv/models/my-model",
    "models.parent": "None",
    "models.max_model_len": "8192",
    "models.owned_by": "vllm",
    "template.tokens_sha256": "3f9a0c1b2d4e5f60",
    "template.token_count": "21",
    "response.model": "my-model",
    "response.system_fingerprint": "vllm-0.32.0-8c1d2e3f",
    **{
        f"metrics.vllm:cache_config_info.{k}": v
        for k, v in {
            "block_size": "16",
            "cache_dtype": "auto",
            "enable_prefix_caching": "False",
            "gpu_memory_utilization": "0.9",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": "27051",
            "swap_space": "4",
        }.items()
    },
    **{
        f"metrics.python_info.{k}": v
        for k, v in {"implementation": "CPython", "major": "3", "minor": "12"}.items()
    },
}
VLLM_HEADERS = {"server": "uvicorn"}


def api_headers(i: int) -> dict[str, str]:
    """What a hosted API sends with every response: unique per request, so never shareable."""
    return {
        "x-request-id": f"req_{random.Random(i).getrandbits(128):032x}",
        "openai-processing-ms": str(200 + i % 300),
        "x-ratelimit-remaining-requests": str(9999 - i % 10000),
        "x-ratelimit-remaining-tokens": str(1999000 - 17 * i),
        "x-ratelimit-reset-requests": "6ms",
        "x-ratelimit-reset-tokens": "0s",
    }


def synthetic(i: int, *, tokens: int, top: int, distinct: bool, headers: dict[str, str]) -> Observation:
    """Observation ``i``: the same answer every time unless ``distinct`` (then new text and logprobs)."""
    rng = random.Random(i if distinct else 0)
    toks = []
    for _ in range(tokens):
        alts = [(f"token_id:{rng.randrange(128000)}", -rng.expovariate(0.5)) for _ in range(top)]
        alts.sort(key=lambda a: -a[1])
        token_id = int(alts[0][0].split(":")[1])
        toks.append(
            TokenLogprob(
                alts[0][0], alts[0][1], token_id, tuple(rng.randrange(256) for _ in range(3)), tuple(alts)
            )
        )
    o = Observation(
        "local",
        "arith-add",
        "default",
        datetime(2026, 1, 1, tzinfo=UTC) + timedelta(minutes=5 * i),
        REQUEST,
        "8e2f1c0a9b3d4e5f",
    )
    o.latency_s = 0.05 + random.Random(i).random() / 10
    o.text = " ".join(t.token for t in toks)
    o.finish_reason, o.prompt_tokens, o.completion_tokens = "length", 21, tokens
    o.system_fingerprint, o.response_model = STACK["response.system_fingerprint"], "my-model"
    o.tokens, o.stack, o.headers = toks, dict(STACK), headers
    return o


def _size(path: Path) -> int:
    db = sqlite3.connect(path)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    pages, page_size = (
        db.execute("PRAGMA page_count").fetchone()[0],
        db.execute("PRAGMA page_size").fetchone()[0],
    )
    db.close()
    return pages * page_size


LATENCY = SignalFit("latency_s", tuple(math.log(0.05 + k / 100) for k in range(10)))  # a calibration's


def growth(
    n: int,
    *,
    distinct: bool,
    tokens: int = 16,
    top: int = 5,
    api: bool = False,
    latency: bool = False,
    workdir: Path | None = None,
) -> int:
    """Bytes the database grows by when N observations follow a baseline (after a WAL checkpoint);
    ``latency``: each judged on a calibrated latency too, as a calibrated backend's are."""
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        path = Path(tmp) / "bench.db"
        store = Store(f"sqlite:///{path}")
        run = store.start_run("local")
        first = synthetic(0, tokens=tokens, top=top, distinct=False, headers=VLLM_HEADERS)
        base_id = store.add_observation(run, first, compare(None, first, correct=True), None)
        before = _size(path)
        for i in range(1, n + 1):
            o = synthetic(
                i, tokens=tokens, top=top, distinct=distinct, headers=api_headers(i) if api else VLLM_HEADERS
            )
            c = compare(first, o, correct=True, baseline_correct=True)
            if latency:
                c = replace(c, latency=LATENCY.score(math.log(o.latency_s)))
            store.add_observation(run, o, c, base_id)
        store.close()
        return _size(path) - before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--top", type=int, default=5)
    a = ap.parse_args()
    same = growth(a.n, distinct=False, tokens=a.tokens, top=a.top)
    diff = growth(a.n, distinct=True, tokens=a.tokens, top=a.top)
    api = growth(a.n, distinct=False, tokens=a.tokens, top=a.top, api=True)
    timed = growth(a.n, distinct=False, tokens=a.tokens, top=a.top, latency=True)
    print(f"{a.n} observations, {a.tokens} tokens × top-{a.top} each, SQLite, after WAL checkpoint:")
    print(f"  identical:                       {same:>10,} bytes  ({same / a.n:,.0f} B/observation)")
    print(f"  distinct (new text + logprobs):  {diff:>10,} bytes  ({diff / a.n:,.0f} B/observation)")
    print(f"  identical / distinct:            {same / diff:>10.1%}  (target < 5%)")
    print(
        f"  identical, hosted-API headers:   {api:>10,} bytes  "
        f"({api / a.n:,.0f} B/observation, {api / diff:.1%})"
    )
    print(
        f"  identical, calibrated latency:   {timed:>10,} bytes  "
        f"({timed / a.n:,.0f} B/observation, {timed / diff:.1%})"
    )


if __name__ == "__main__":
    main()
