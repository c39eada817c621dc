"""The detection bench's figures and tables: power, false alarms, ROC AUC, budgets, the targets, and the
printed product-path, MET and race tables."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING

from bench.detection_lab import HONEST, Served
from bench.detection_met import MET_ROW, met_table, met_trials
from bench.detection_methods import OURS, REFERENCE_ROW, REQUESTS, Outcome, Reference, permutations_for
from bench.detection_peers import DIFR, PEER_REQUESTS
from bench.detection_product import SUITES
from bench.detection_product import table as product_table
from bench.detection_race import per_method_table, race_table, refit_probes, tally
from bench.intervals import clopper_pearson, rate
from bench.peers import roc_auc

if TYPE_CHECKING:
    from bench.detection import Settings

POWER = 0.95
TOKEN_TARGET = 48  # LT's budget per test in its paper (28 input + 20 output tokens)
SCORED_TARGET = 300  # Token-DiFR: 4-bit quantisation at AUC > 0.999 within 300 scored tokens

Cells = dict[tuple[str, str], dict[int, list[Outcome]]]  # (method, variant) → budget r → outcomes


def power(outcomes: Sequence[Outcome]) -> float:
    return sum(o.reject for o in outcomes) / len(outcomes)


def tokens_per_request(name: str, s: Served) -> float:
    kind = (REQUESTS | PEER_REQUESTS).get(name, ("greedy", ""))[0]
    return {
        "greedy": s.tokens,
        "sample": s.sample_tokens,
        "lt": s.lt_tokens,
        "forced": s.forced_tokens,
        "tracking": s.tracking_tokens,
    }[kind]


def figures(cells: Cells, ladder: Sequence[str], c: int, tokens: dict[str, float]) -> dict:
    """Power, false alarms, AUC (variant vs N0, and the pooled ladder vs N0) and the budget for power 0.95."""
    out: dict = {"cells": {}, "methods": {}}
    for (name, variant), by_r in cells.items():
        null = cells.get((name, "N0"), {})
        need = next((r for r in sorted(by_r) if power(by_r[r]) >= POWER), None)
        out["cells"][f"{name} | {variant}"] = {
            "method": name,
            "variant": variant,
            "power": {r: power(x) for r, x in by_r.items()},
            "hits": {r: sum(o.reject for o in x) for r, x in by_r.items()},
            "trials": {r: len(x) for r, x in by_r.items()},
            "auc_vs_n0": {
                r: roc_auc([o.score for o in x], [o.score for o in null.get(r, [])]) for r, x in by_r.items()
            },
            "power_095": None
            if need is None or variant in HONEST
            else cost(c * need + refit_probes(cells, name, need, (variant,)), tokens[name], need),
        }
    for name in dict.fromkeys(n for n, _ in cells):
        null = cells.get((name, "N0"), {})
        rs = sorted(null)
        auc = {
            r: roc_auc(
                [o.score for v in ladder for o in cells.get((name, v), {}).get(r, [])],
                [o.score for o in null[r]],
            )
            for r in rs
        }
        per_test = {r: (c * r + refit_probes(cells, name, r)) * tokens[name] for r in rs}
        cheap = [r for r in rs if per_test[r] <= TOKEN_TARGET]
        # the smallest budget at which every ladder variant is detected with power 0.95
        need = next(
            (r for r in rs if all(power(cells[(name, v)][r]) >= POWER for v in ladder if (name, v) in cells)),
            None,
        )
        out["methods"][name] = {
            "requests_per_test": (REQUESTS | PEER_REQUESTS).get(name, ("", "C·r"))[1],
            "tokens_per_request": tokens[name],
            "tokens_per_test": {r: round(t) for r, t in per_test.items()},
            "ladder_auc": auc,
            "ladder_auc_within_token_target": auc[max(cheap)] if cheap else None,
            "false_alarms_n0": {r: f"{sum(o.reject for o in null[r])}/{len(null[r])}" for r in rs},
            "ladder_power_095": None
            if need is None
            else cost(c * need + refit_probes(cells, name, need, ladder), tokens[name], need),
        }
    return out


def cost(requests: float, per_request: float, r: float) -> dict:
    """A budget at r: requests per test (a detector's refit probes included) and their tokens."""
    shown = int(requests) if requests == int(requests) else round(requests, 1)
    return {"r": r, "requests": shown, "tokens": round(requests * per_request)}


def power_table(cells: Cells, figs: dict, variants: Sequence[str], rs: Sequence[int]) -> str:
    """Per variant × method: power per budget r (N0 and F: false alarms as hits/trials), and the budget
    for power 0.95."""
    head = "| variant | method | " + " | ".join(f"r={r}" for r in rs) + " | power 0.95 at |"
    lines = [head, "|" + "---|" * (len(rs) + 3)]
    for variant in variants:
        for (name, v), by_r in cells.items():
            if v != variant:
                continue
            cellf = figs["cells"][f"{name} | {v}"]
            row = []
            for r in rs:
                x = by_r.get(r)
                if x is None:
                    row.append("—")
                elif v in HONEST:
                    row.append(rate(sum(o.reject for o in x), len(x)))
                else:
                    row.append(f"{power(x):.2f}")
            need = cellf["power_095"]
            need_s = (
                "(honest)"
                if v in HONEST
                else "not reached"
                if need is None
                else (f"r={need['r']}: {need['requests']} req, {need['tokens']} tok")
            )
            lines.append(f"| {v} | {name} | " + " | ".join(row) + f" | {need_s} |")
    return "\n".join(lines)


def method_table(figs: dict, rs: Sequence[int]) -> str:
    head = (
        "| method | requests per test | tokens per test (r="
        + ",".join(map(str, rs))
        + ") | ladder AUC (r="
        + ",".join(map(str, rs))
        + f") | AUC at ≤ {TOKEN_TARGET} tok | false alarms N0 (r="
        + ",".join(map(str, rs))
        + ") | all ladder at power 0.95 |"
    )
    lines = [head, "|---|---|---|---|---|---|---|"]
    for name, m in figs["methods"].items():
        tok = "/".join(str(m["tokens_per_test"].get(r, "—")) for r in rs)
        auc = "/".join(f"{m['ladder_auc'][r]:.3f}" if r in m["ladder_auc"] else "—" for r in rs)
        fa = " ".join(m["false_alarms_n0"].get(r, "—") for r in rs)
        cheap = (
            "—"
            if m["ladder_auc_within_token_target"] is None
            else f"{m['ladder_auc_within_token_target']:.3f}"
        )
        need = m["ladder_power_095"]
        need_s = (
            "not reached" if need is None else f"r={need['r']}: {need['requests']} req, {need['tokens']} tok"
        )
        lines.append(f"| {name} | {m['requests_per_test']} | {tok} | {auc} | {cheap} | {fa} | {need_s} |")
    return "\n".join(lines)


def targets(
    figs: dict, cells: Cells, tokens: dict[str, float], c: int, scored: float, alpha: float, race: dict
) -> list[str]:
    """The issue's targets for canaryd, each with what this run measured (printed, not asserted).

    ``c``: canaries per cycle; ``scored``: the answer tokens per greedy request, what a reference scores
    (Token-DiFR's unit); ``race``: `detection_race.race` of the same cells."""
    lines = []
    # the fleet is honest for canaryd's own modes; for the reference check its bf16 member is a true mismatch
    honest = [(name, v) for name in OURS for v in HONEST] + [(REFERENCE_ROW, "N0")]
    for name, variant in honest:
        by_r = cells.get((name, variant), {})
        if not by_r:
            continue
        worst_r = max(by_r, key=lambda r: sum(o.reject for o in by_r[r]))
        hits, n = sum(o.reject for o in by_r[worst_r]), len(by_r[worst_r])
        high = clopper_pearson(hits, n)[1]
        met = all(sum(o.reject for o in x) <= alpha * len(x) for x in by_r.values()) and high < 2 * alpha
        lines.append(
            f"{name}: per-test false alarms on {variant} ≤ α with the 95% upper bound below 2α: "
            f"{'met' if met else 'NOT met'} (worst budget r = {worst_r:g}: {hits}/{n}, upper bound "
            f"{high:.4f}{'' if high < 2 * alpha else f'; 0 hits need ≥ {zero_hit_tests(alpha)} tests'})"
        )
    for name in OURS:
        if name not in figs["methods"]:
            continue
        cheap = figs["methods"][name]["ladder_auc_within_token_target"]
        lines.append(
            f"{name}: ladder AUC ≥ 0.95 within {TOKEN_TARGET} tokens per test: "
            + (
                f"{'met' if cheap >= 0.95 else 'NOT met'} ({cheap:.3f})"
                if cheap is not None
                else f"not measurable (one request costs {tokens[name]:.0f} tokens)"
            )
        )
    verdicts: dict[tuple[str, str], list[str]] = {}
    for x in race["equal_tokens"]:
        verdicts.setdefault((x["against"], x["peer"]), []).append(x["verdict"])
    for (against, peer), vs in verdicts.items():
        behind = vs.count("behind")
        counts = f"{vs.count('ahead')} ahead, {vs.count('tie')} tie, {behind} behind of {len(vs)} budgets"
        if against == "best":
            lines.append(
                f"canaryd's best mode never behind {peer} by more than 0.01 at equal tokens (CI): "
                f"{'met' if not behind else 'NOT met'} ({counts})"
            )
        else:  # no target of its own: where the shipped suite alone stands, behind included
            lines.append(f"canaryd's shipped suite (where not the best mode) against {peer}: {counts}")
    for name in (DIFR, REFERENCE_ROW):
        for variant in ("Q2", "Q1"):
            cell = figs["cells"].get(f"{name} | {variant}")
            if cell is None:
                continue
            fits = [r for r in cell["auc_vs_n0"] if c * r * scored <= SCORED_TARGET]
            if not fits:
                continue
            r = max(fits)
            auc = cell["auc_vs_n0"][r]
            lines.append(
                f"{name} catches {variant} at AUC ≥ 0.999 within {SCORED_TARGET} scored tokens (Token-DiFR's "
                f"target): {'met' if auc >= 0.999 else 'NOT met'} (AUC {auc:.3f} at r = {r:g}, "
                f"{round(c * r * scored)} scored tokens)"
            )
    return lines


def zero_hit_tests(alpha: float) -> int:
    """How many tests without an alarm bring the Clopper–Pearson upper bound below 2α."""
    return next(n for n in range(1, 10**6) if clopper_pearson(0, n)[1] < 2 * alpha)


def print_product(servers: dict[str, list[Served]], settings: Settings, quick: bool) -> dict:
    """The product path's figures (printed): per variant and shipped suite, pooled over its servers."""
    results = {
        v: {suite: [p for s in ss for p in s.product.get(suite, [])] for suite in SUITES}
        for v, ss in servers.items()
        if any(s.product for s in ss)
    }
    print(
        f"PRODUCT PATH ({'QUICK: ' if quick else ''}{settings.product_trials} `canaryd check` passes per "
        "server and suite, each from a fresh copy of the deployed state; N0 pooled over its restarts; FQ1 "
        "is composed, not served, so it has none): an alarm is exit code 1"
    )
    print(product_table(results, honest=HONEST))
    return {v: {suite: [asdict(p) for p in ps] for suite, ps in by.items()} for v, by in results.items()}


def print_met(
    ref: Reference, servers: dict[str, list[Served]], ladder: list[str], settings: Settings, args
) -> dict:
    """MET at its paper's settings (printed): its trials per served variant (FQ1 is composed: none)."""
    rng = random.Random(f"{args.seed}-met")
    b = permutations_for(args.alpha, settings.permutation_floor)
    results = {
        v: [x for s in ss for x in met_trials(ref.met, s.met, settings.trials, args.alpha, b, rng)]
        for v, ss in servers.items()
        if all(s.met for s in ss)
    }
    print(
        f"{MET_ROW}: {settings.trials} trials per server, {b} permutations, each trial 10 of the "
        f"{settings.met_pool} completions per prompt a server gave; ignore_eos and min_tokens = 50"
        + (" (QUICK: a pool of 12 per prompt, so trials overlap)" if args.quick else "")
    )
    print("\n".join(met_table(results, ladder, args.seed, settings.resamples)))
    return {v: [[a, p] for a, p in xs] for v, xs in results.items()}


def print_race(label: str, result: dict, off: dict[str, str] | None, rs) -> None:
    """The race of one row set: per method with intervals, then the differences from canaryd."""
    print(f"{label}, per method and budget: ladder AUC with a bootstrap 95% CI, false alarms with bounds")
    print(per_method_table(result, rs, off))
    print()
    print(f"{label}, at equal requests: canaryd's mode − each method (paired bootstrap CI; inside: tie)")
    print(race_table(result, "requests"))
    print()
    print(f"{label}, at equal tokens per test: canaryd's best mode within the budget − each method")
    print(race_table(result, "tokens"))
    print(f"{label}, at equal tokens: {tally(result)}")
