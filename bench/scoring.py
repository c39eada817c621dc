"""Scoring a probe against a noise model's K references: `distance` one reference at a time (a model's
first score, and every score before `canaryd.judge.nearest`) beside `Nearest` (every later score), side by
side in one run.

Synthetic points shaped like a vLLM answer of 32 tokens, each with the chosen token and 4 alternatives.
"continuous": every reference differs (a GPU's or an API's noise, jitter of 0.01 nats); "exact": the K
references are identical (an exact engine), and the probes are jittered. CPU per probe scored, and of
building the arrays once per model (what a model's second score pays), medians of ``--runs``.

    .venv/bin/python bench/scoring.py [--probes 300] [--runs 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from canaryd.judge.nearest import Nearest
from canaryd.judge.stats import NoiseModel, Point, distance, fit_points, max_abs_delta

TOKENS, ALTERNATIVES = 32, 4


def probe(rng: random.Random, jitter: float) -> Point:
    ids = tuple(f" w{i}" for i in range(TOKENS))
    coords = {}
    for i, tok in enumerate(ids):
        coords[(i, tok)] = -0.05 * (i % 7) + (rng.gauss(0, jitter) if jitter else 0.0)
        for j in range(ALTERNATIVES):
            coords[(i, f" alt{i}_{j}")] = -2.0 - j + (rng.gauss(0, jitter) if jitter else 0.0)
    return Point(ids, coords)


def one_by_one(model: NoiseModel, probes: list[Point]) -> None:
    """What `score_point` did: `distance` to each reference, `max_abs_delta` to the nearest."""
    for x in probes:
        d = [distance(x, r, model.spread, model.default_spread) for r in model.refs]
        max_abs_delta(x, model.refs[min(range(len(d)), key=d.__getitem__)])


def column_wise(arrays: Nearest, probes: list[Point]) -> None:
    for x in probes:
        arrays.score(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--probes", type=int, default=300)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    rng = random.Random(3)
    print(f"CPU per probe scored and per model built, ms (medians of {args.runs} runs, {args.probes} probes)")
    print(f"{'K':>3} {'references':<11} {'one by one':>11} {'column-wise':>12} {'ratio':>6} {'build':>7}")
    for k in (5, 10, 20):
        for label, jitter in (("continuous", 0.01), ("exact", 0.0)):
            model = fit_points("r", tuple(probe(rng, jitter) for _ in range(k)), {})
            probes = [probe(rng, 0.01) for _ in range(args.probes)]
            Nearest(model.refs, model.spread, model.default_spread).score(probes[0])  # numpy imported
            rounds = []
            for _ in range(args.runs):  # side by side in each round
                t = time.process_time()
                arrays = Nearest(model.refs, model.spread, model.default_spread)
                built = time.process_time() - t
                pair = []
                for fn, on in ((one_by_one, model), (column_wise, arrays)):
                    t = time.process_time()
                    fn(on, probes)
                    pair.append((time.process_time() - t) / len(probes))
                rounds.append((*pair, built))
            old, new, built = (statistics.median(r[i] for r in rounds) for i in (0, 1, 2))
            ms = f"{old * 1e3:>11.3f} {new * 1e3:>12.3f} {old / new:>5.1f}x {built * 1e3:>7.3f}"
            print(f"{k:>3} {label:<11} {ms}")


if __name__ == "__main__":
    main()
