"""Where the detection race's honest alarms come from: its noise shim on honest servers alone, per deployment.

`detection.py`, before its rows refit, found its tracking suite above α under the SYNTHETIC gpu-bf16 shim
(21 of 1,000 honest tests at r = 16; none since the refits). This runs the same shim
(`detection_shim.shim_outcomes`: each deployment draws fresh engine paths and
a calibration over SHIM_CAL_DAYS simulated days, or ``--cal-days``; each test is a new day) on an exact
server's answers, with no vLLM: C one-token canaries, each answering the same token with a fixed top-20 (the
tracking suite's shape), K calibration probes each, at the race's α and its rule (`alpha_rule`). canaryd's
three detector rows judge the same kind of canary on calibrations drawn apart, so they are three more
deployments each. Per row: alarms of the r-cycle tests, the rule that raised each (`Decision.raised`), how
many deployments had one, and the share of canary-cycles out against the conformal bound 1/(K+1), over all
deployments and deployment by deployment (the bound holds on average over calibrations, not given one).

The same K probes spread over more days (``--cal-days``) see more of the day-to-day load mixes at no cost in
requests, only in the calendar time a calibration spans.

    .venv/bin/python bench/shim_null.py [--preset gpu-bf16] [--tests 1000] [--deployments 5] [--r 16]
        [--cal-days 4] [--each]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.detection_lab import SHIM_CAL_DAYS, Served, check_key
from bench.detection_methods import OURS, Reference
from bench.detection_peers import split
from bench.detection_race import describe_rules, rule_counts
from bench.detection_shim import shim_outcomes
from bench.intervals import clopper_pearson
from canaryd.canaries import Canary, Decoding
from canaryd.config import CompareConfig
from canaryd.judge.reference import Divergence
from canaryd.observation import Observation, TokenLogprob
from canaryd.probe.reference import Check

TOP = 20


@dataclass(frozen=True)
class Settings:  # what `shim_outcomes` reads of `detection.Settings`
    r_probes: tuple[int, ...]
    null_trials: int
    trials: int = 0
    deployments: int = 1
    permutation_floor: int = 0
    lt_max_n: int = 50


def answer(cid: str, rng: random.Random) -> Observation:
    """One token with a fixed top-20 whose logprobs fall like a small LM's."""
    scores = sorted((rng.gauss(0.0, 2.5) for _ in range(TOP)), reverse=True)
    norm = math.log(sum(math.exp(s) for s in scores)) + 0.3  # the rest of the vocabulary holds some mass
    top = tuple((f"t{j}", s - norm) for j, s in enumerate(scores))
    o = Observation("b", cid, "t", datetime(2026, 1, 1, tzinfo=UTC), {}, "r")
    o.text, o.finish_reason, o.stack = "t0", "length", {"response.system_fingerprint": "f32"}
    o.tokens = [TokenLogprob("t0", top[0][1], top=top)]
    return o


def honest(c: int, k: int, pool: int, seed: int) -> tuple[Reference, dict[str, list[Served]]]:
    """The reference side and one honest exact server: every probe of a canary is the same answer."""
    rng = random.Random(seed)
    ids = [f"t{i}" for i in range(c)]
    base = {cid: answer(cid, rng) for cid in ids}
    shape = Canary(id="t", prompt="a", decoding=Decoding(max_tokens=1, top_logprobs=TOP), suite="t")
    canaries = [shape.model_copy(update={"id": cid}) for cid in ids]

    def probes(n: int) -> dict[str, list[Observation]]:
        return {cid: [base[cid]] * n for cid in ids}

    ref = Reference(canaries, probes(k), {}, {}, {}, [base[ids[0]]] * 8, k)
    ref.forced, ref.forced_calibration = canaries, probes(k)
    ref.tracking, ref.tracking_calibration = canaries, probes(k)
    same = Check(Divergence(0.0, 0.0, 1, logprob_gap=0.0), parting=0.0, noise=0.0, gap_noise=(0.0, 0.0))
    for o in base.values():  # the reference scores the answer as the server does
        ref.checks[check_key(o)], ref.scored[check_key(o)] = same, tuple(o.tokens)
    greedy = probes(pool)
    extra = {"forced": greedy, "tracking": greedy}
    return ref, {"N0": [Served("N0", greedy, greedy, greedy[ids[0]], 1, 1, 1, 0, 1, 1, extra)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpu-bf16", help="a realistic-model preset, or σ_mode in nats")
    ap.add_argument("--tests", type=int, default=1000, help="honest tests per row (split over deployments)")
    ap.add_argument("--deployments", type=int, default=5)
    ap.add_argument("--r", type=int, default=16, help="cycles per test")
    ap.add_argument("--canaries", type=int, default=6)
    ap.add_argument("--alpha", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cal-days", type=int, default=SHIM_CAL_DAYS, help="days the K calibration probes span")
    ap.add_argument("--each", action="store_true", help="also print every deployment's row")
    ap.add_argument(
        "--fixed",
        action="store_true",
        help="judge against the calibration alone, without the product's refits",
    )
    args = ap.parse_args()
    if args.cal_days < 1:
        ap.error("--cal-days must be at least 1")
    level = args.preset if args.preset[0].isalpha() else float(args.preset)
    k = CompareConfig().calibration_k
    ref, servers = honest(args.canaries, k, 16, args.seed)
    settings = Settings((args.r,), args.tests // args.deployments)
    print(
        f"SYNTHETIC shim {level}: {args.canaries} one-token top-{TOP} canaries, K = {k}, r = {args.r}, "
        f"α = {args.alpha}, calibration over {args.cal_days} days, {settings.null_trials} honest tests per "
        f"deployment; bound 1/(K+1) = {1 / (k + 1):.3f}; "
        + ("the calibration alone" if args.fixed else "with the product's refits")
    )
    seen: dict[str, list[Deployed]] = {row: [] for row in OURS}
    living = not args.fixed
    for d in range(args.deployments):
        seed = args.seed * 1000 + d
        out = split(shim_outcomes(level, ref, servers, settings, args.alpha, seed, args.cal_days, living))
        for row in OURS:
            seen[row].append(Deployed.of(out[(row, "N0")][args.r], args.r * args.canaries))
    if args.each:
        print("| row | deployment | alarms | raised by | canary-cycles out [95% CI] |")
        print("|---|---|---|---|---|")
        for row, deployed in seen.items():
            for d, x in enumerate(deployed):
                out = f"{x.rate:.4f} {_interval(x.outs, x.cells)}"
                print(f"| {row} | {d} | {x.alarms}/{x.tests} | {_rules(x.rules)} | {out} |")
        print()
    bound = 1 / (k + 1)
    print(
        "| row | honest tests alarmed [95% CI] | raised by | deployments with an alarm | canary-cycles out "
        "[95% CI] | out per deployment: min / median / max | deployments out above 1/(K+1) (95% CI) | refit "
        "probes per test |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row, deployed in seen.items():
        alarms, tests = sum(x.alarms for x in deployed), sum(x.tests for x in deployed)
        outs, cells = sum(x.outs for x in deployed), sum(x.cells for x in deployed)
        rules = sum((x.rules for x in deployed), Counter())
        rates = sorted(x.rate for x in deployed)
        above = sum(clopper_pearson(x.outs, x.cells)[0] > bound for x in deployed)
        print(
            f"| {row} | {alarms}/{tests} {_interval(alarms, tests)} | {_rules(rules)} | "
            f"{sum(x.alarms > 0 for x in deployed)} of {len(deployed)} | {outs / cells:.4f} "
            f"{_interval(outs, cells)} | {rates[0]:.3f} / {statistics.median(rates):.3f} / {rates[-1]:.3f} | "
            f"{above} of {len(deployed)} | {sum(x.refit_probes for x in deployed) / tests:.2f} |"
        )


@dataclass(frozen=True)
class Deployed:
    """One deployment's honest tests of one row."""

    alarms: int
    tests: int
    rules: Counter[str]  # alarms by the rule that raised them (a cycle can meet two)
    outs: int  # canary-cycles out
    cells: int  # canary-cycles
    refit_probes: int  # requests the refits sent beyond the tests' own

    @property
    def rate(self) -> float:
        return self.outs / self.cells

    @classmethod
    def of(cls, tests: list, per_test: int) -> Deployed:
        outs = sum(o.score[2] for o in tests)  # the detector's score: (alarm, peak e-CUSUM, outs so far)
        spent = sum(o.refit_probes for o in tests)
        return cls(
            sum(o.reject for o in tests), len(tests), rule_counts(tests), outs, len(tests) * per_test, spent
        )


def _rules(rules: Counter[str]) -> str:
    return describe_rules(rules) or "—"


def _interval(hits: int, n: int) -> str:
    lo, hi = clopper_pearson(hits, n)
    return f"[{lo:.4f}, {hi:.4f}]"


if __name__ == "__main__":
    main()
