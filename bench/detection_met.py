"""MET at its paper's settings in the detection bench: 25 distinct open-ended prompts, 10 completions of 50
tokens a prompt and side, temperature 1 (Gao et al., "Model Equality Testing", ICLR 2025, §4: 25 prompts ×
10 samples; `i-gao/model-equality-testing`), its statistic as `peers.met_test` computes it (the
prompt-blocked Hamming kernel, within-prompt permutations).

The tiny model ends most answers within a few tokens, so every completion is requested with vLLM's
``ignore_eos`` and ``min_tokens`` at 50: each is exactly 50 tokens, as MET's length-50 kernel reads them.
The requests go to the server's `/v1/completions` directly (a raw prompt, a fresh seed each), as MET's own
code calls an API, not through a canaryd canary (canaryd sends neither parameter).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import httpx2
import numpy as np

from bench.detection_lab import HONEST
from bench.intervals import auc_interval, clopper_pearson
from bench.peers import met_test

MET_ROW = "MET at its paper's settings (25 prompts × 10 completions, 50 tokens, T = 1)"
MET_TOKENS = 50
MET_SAMPLES = 10  # completions per prompt and side in one test
# open-ended, distinct, short: what a language model continues freely (not the canaries' known answers)
MET_PROMPTS = (
    "Once upon a time",
    "The weather today is",
    "My favourite food is",
    "In the city of",
    "The best way to learn",
    "Yesterday I saw",
    "The history of the",
    "A good friend is",
    "When the sun goes down",
    "The old house on the hill",
    "Scientists have found that",
    "The recipe calls for",
    "On the first day of school",
    "The river flows",
    "Music makes people",
    "The train left the station",
    "In the middle of the night",
    "The market sells",
    "Every morning she",
    "The letter said",
    "At the end of the road",
    "The children played",
    "A new study shows",
    "The mountain was",
    "He opened the door and",
)
CONCURRENCY = 8
ATTEMPTS = 3  # a seeded completion sent again is the same completion


def completions(base_url: str, n: int, rng: random.Random) -> dict[str, list[tuple[str, ...]]]:
    """``n`` completions of ``MET_TOKENS`` tokens per prompt at temperature 1, each with its own seed."""
    jobs = [(p, rng.getrandbits(31)) for p in MET_PROMPTS for _ in range(n)]

    with httpx2.Client(base_url=base_url, timeout=300) as client:

        def one(job: tuple[str, int]) -> tuple[str, ...]:
            prompt, seed = job
            body = {
                "model": "tiny",
                "prompt": prompt,
                "max_tokens": MET_TOKENS,
                "min_tokens": MET_TOKENS,
                "ignore_eos": True,
                "temperature": 1.0,
                "seed": seed,
                "logprobs": 0,  # the tokens of the completion, one by one
            }
            for attempt in range(ATTEMPTS):
                try:
                    r = client.post("/completions", json=body)
                    break
                except httpx2.TransportError:  # a connection dropped without an answer (seen mid-run)
                    if attempt + 1 == ATTEMPTS:
                        raise
            r.raise_for_status()
            tokens = tuple(r.json()["choices"][0]["logprobs"]["tokens"])
            if len(tokens) != MET_TOKENS:
                why = f"{prompt!r} got {len(tokens)} tokens, not {MET_TOKENS}"
                raise SystemExit(f"detection bench, MET: {why}")
            return tokens

        with ThreadPoolExecutor(CONCURRENCY) as pool:
            got = list(pool.map(one, jobs))
    out: dict[str, list[tuple[str, ...]]] = {p: [] for p in MET_PROMPTS}
    for (prompt, _), tokens in zip(jobs, got, strict=True):
        out[prompt].append(tokens)
    return out


def met_trials(
    base: dict[str, list[tuple[str, ...]]],
    tested: dict[str, list[tuple[str, ...]]],
    trials: int,
    alpha: float,
    permutations: int,
    rng: random.Random,
) -> list[tuple[bool, float]]:
    """Each trial MET_SAMPLES completions per prompt from each pool, MET's test: (alarm at alpha, p)."""
    codes: dict[str, int] = {}

    def coded(c: tuple[str, ...]) -> list[int]:
        return [codes.setdefault(t, len(codes)) for t in c]

    npr = np.random.default_rng(rng.getrandbits(63))
    out = []
    for _ in range(trials):
        s1 = {p: [coded(c) for c in rng.sample(base[p], MET_SAMPLES)] for p in MET_PROMPTS}
        s2 = {p: [coded(c) for c in rng.sample(tested[p], MET_SAMPLES)] for p in MET_PROMPTS}
        t = met_test(s1, s2, MET_TOKENS, permutations=permutations, rng=npr)
        out.append((t.p_value <= alpha, t.p_value))
    return out


def met_table(
    results: dict[str, list[tuple[bool, float]]], ladder: Sequence[str], seed: int, resamples: int
) -> list[str]:
    """Per variant power (the honest N0 and F: false alarms) with its Clopper–Pearson interval, and the
    ladder AUC (scores −p, ladder against N0) with its bootstrap interval."""
    lines = []
    for variant, outcomes in results.items():
        hits = sum(a for a, _ in outcomes)
        low, high = clopper_pearson(hits, len(outcomes))
        what = "false alarms" if variant in HONEST else "power"
        lines.append(f"{variant}: {what} {hits}/{len(outcomes)} [{low:.3f}, {high:.3f}]")
    pos = [-p for v in ladder for _, p in results.get(v, [])]
    neg = [-p for _, p in results.get("N0", [])]
    auc = auc_interval(pos, neg, rng=np.random.default_rng(seed), resamples=resamples)
    lines.append(f"ladder AUC ({', '.join(v for v in ladder if v in results)} vs N0): {auc}")
    return lines
