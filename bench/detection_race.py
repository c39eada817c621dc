"""The detection bench's race: every method's ladder AUC with a bootstrap interval, its difference from
canaryd's with a paired interval (a difference inside its interval is a tie), per-test false-alarm rates
with Clopper–Pearson bounds, at equal requests and, separately, at equal tokens per test, with what each
method spends off the test (calibration, reference windows) in a column of its own."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from bench.detection_lab import HONEST
from bench.detection_methods import OURS, REFERENCE_ROW, SHIPPED, TRACKING_ROW, Outcome
from bench.detection_peers import DIFR, LT, LT_P, LT_PROD, MET
from bench.intervals import Interval, auc_difference, auc_interval, clopper_pearson, verdict

Cells = dict[tuple[str, str], dict[float, list[Outcome]]]
# rows the race leaves out of its differences: canaryd's shipped knobs (the same mode), and LT's production
# rule (LT's own trials and statistic, so LT's AUC: it differs in its decisions, which the per-method table
# shows)
NOT_RACED = (LT_PROD,)


def raced(name: str) -> bool:
    return name not in OURS and name not in NOT_RACED and not name.startswith("canaryd (defaults")


MARGIN = 0.01  # the targets' tolerance: never behind by more than this


def off_test_cost(name: str, c: int, k: int, tokens: dict[str, float]) -> str:
    """What a method spends besides its tests: per deployment (calibration, reference window) or per test
    (a fresh reference sample, a reference's scoring)."""
    if name in ("canaryd", "canaryd (defaults: arl 10000)"):
        return f"calibration {k * c} req, {round(k * c * tokens['canaryd']):,} tok per deployment"
    if name in ("canaryd teacher-forced", TRACKING_ROW):
        return f"calibration {k * c} req, {round(k * c * tokens[name]):,} tok per deployment"
    if name == REFERENCE_ROW:
        return "canaryd's calibration (the provider's floors) + C·r scorings on the reference per test"
    if name == DIFR:
        return "canaryd's calibration (its honest margins) + C·r scorings on the reference per test"
    if name in (LT, LT_P):
        return f"reference window {k * c} req, {round(k * c * tokens[LT]):,} tok per deployment"
    if name == LT_PROD:
        return f"as LT, and a history of 148 tests before its first alarm ({k * c} req reference)"
    if name in (MET, "two-sample text (T=1)"):
        return "C·r reference samples per test (as many tokens as the test)"
    return "the baseline's C answers"


def ladder_scores(cells: Cells, name: str, ladder: Sequence[str], r: float) -> tuple[list, list]:
    """(positives, negatives) of the ladder AUC at budget r: every ladder variant's trials against N0's."""
    pos = [o.score for v in ladder for o in cells.get((name, v), {}).get(r, [])]
    return pos, [o.score for o in cells.get((name, "N0"), {}).get(r, [])]


def ladder_power(cells: Cells, name: str, ladder: Sequence[str], r: float) -> float:
    hits = [o.reject for v in ladder for o in cells.get((name, v), {}).get(r, [])]
    return sum(hits) / len(hits) if hits else float("nan")


def false_alarms(cells: Cells, name: str, variant: str, r: float) -> tuple[int, int, float]:
    """(hits, tests, the Clopper–Pearson upper bound of the per-test rate)."""
    x = cells.get((name, variant), {}).get(r, [])
    hits = sum(o.reject for o in x)
    return hits, len(x), clopper_pearson(hits, len(x))[1] if x else float("nan")


def rule_counts(outcomes: Iterable[Outcome]) -> Counter[str]:
    """How many of these alarms each rule raised (a cycle can meet several): for a detector's honest tests,
    which path the false alarms came through."""
    return Counter(rule for o in outcomes if o.reject for rule in o.raised)


def describe_rules(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{rule} {n}" for rule, n in sorted(counts.items()))


def refit_probes(cells: Cells, name: str, r: float, variants: Iterable[str] | None = None) -> float:
    """A detector's refit probes per test at budget r (`detection_living`), over ``variants`` (every one):
    requests of the test like its C·r, so its requests and tokens count them."""
    spent = [
        o.refit_probes
        for (n, v), by_r in cells.items()
        if n == name and (variants is None or v in variants)
        for o in by_r.get(r, [])
    ]
    return sum(spent) / len(spent) if spent else 0.0


def race(
    cells: Cells, ladder: Sequence[str], c: int, tokens: dict[str, float], seed: int, resamples: int
) -> dict:
    """Per method and budget: AUC with interval, power, false alarms with bounds; then at equal requests
    and at equal tokens, each method against canaryd (each mode at equal requests; at equal tokens the
    best mode within the budget, and the shipped default suite where it fits the budget and is not the
    best), the difference with a paired interval and its verdict."""
    rng = np.random.default_rng(seed)
    names = list(dict.fromkeys(n for n, _ in cells))
    per: dict[str, dict[float, dict]] = {}
    for name in names:
        per[name] = {}
        for r in sorted(cells.get((name, "N0"), {})):
            auc = auc_interval(*ladder_scores(cells, name, ladder, r), rng=rng, resamples=resamples)
            fa = {v: false_alarms(cells, name, v, r) for v in HONEST if (name, v) in cells}
            extra = refit_probes(cells, name, r)
            per[name][r] = {
                "tokens": (c * r + extra) * tokens[name],
                "refit_probes": extra,
                "auc": auc,
                "power": ladder_power(cells, name, ladder, r),
                "false_alarms": fa,
                "raised": {v: dict(rule_counts(cells[(name, v)].get(r, []))) for v in fa},
            }

    def diff(a: str, ra: float, b: str, rb: float) -> Interval:
        return auc_difference(
            ladder_scores(cells, a, ladder, ra),
            ladder_scores(cells, b, ladder, rb),
            rng=rng,
            resamples=resamples,
        )

    requests = []
    for r in sorted({r for n in OURS if n in per for r in per[n]}):
        for name in names:
            if not raced(name) or r not in per[name]:
                continue
            for ours in OURS:
                if r in per.get(ours, {}):
                    d = diff(ours, r, name, r)
                    requests.append(
                        {"r": r, "ours": ours, "peer": name, "diff": d, "verdict": verdict(d, MARGIN)}
                    )

    budgets = sorted({round(x["tokens"]) for n in OURS if n in per for x in per[n].values()})
    tokens_rows = []
    for budget in budgets:

        def within(name: str, budget: int = budget) -> float | None:
            fits = [r for r, x in per[name].items() if x["tokens"] <= budget * (1 + 1e-9)]
            return max(fits) if fits else None

        ours = [(n, r) for n in OURS if n in per and (r := within(n)) is not None]
        if not ours:
            continue
        best = max(ours, key=lambda m: per[m[0]][m[1]]["auc"].value)
        against = [("best", best)] + [("shipped", m) for m in ours if m[0] == SHIPPED and m != best]
        for name in names:
            if not raced(name) or (r := within(name)) is None:
                continue
            for role, (mode, rm) in against:
                d = diff(mode, rm, name, r)
                tokens_rows.append(
                    {
                        "tokens": budget,
                        "against": role,
                        "ours": mode,
                        "ours_r": rm,
                        "peer": name,
                        "peer_r": r,
                        "diff": d,
                        "verdict": verdict(d, MARGIN),
                    }
                )
    return {"per": per, "equal_requests": requests, "equal_tokens": tokens_rows}


def _fa(fa: dict, raised: dict) -> str:
    """Each honest variant's false alarms, with the rules that raised a detector's (`rule_counts`)."""

    def rules(v: str) -> str:
        return f", by {describe_rules(raised[v])}" if raised.get(v) else ""

    return "; ".join(f"{v} {h}/{n} (≤ {ub:.3f}{rules(v)})" for v, (h, n, ub) in fa.items()) or "—"


def per_method_table(
    result: dict, rs: Sequence[float] | None = None, off: dict[str, str] | None = None
) -> str:
    """Per method and budget: tokens per test, ladder AUC [95% CI], ladder power, false alarms with their
    Clopper–Pearson upper bounds; the off-test cost once per method."""
    lines = [
        "| method | r | tokens/test (refit probes a test) | ladder AUC [95% CI] | ladder power | false "
        "alarms (≤ 95% upper) |",
        "|---|---|---|---|---|---|",
    ]
    for name, by_r in result["per"].items():
        for r, x in by_r.items():
            if rs is not None and r not in rs and name not in (LT, LT_P, LT_PROD):
                continue
            fa = _fa(x["false_alarms"], x["raised"])
            cost = f"{x['tokens']:,.0f}" + (f" ({x['refit_probes']:.2f})" if x.get("refit_probes") else "")
            lines.append(f"| {name} | {r:g} | {cost} | {x['auc']} | {x['power']:.2f} | {fa} |")
    if off:
        lines += ["", "| method | off-test cost (not in tokens/test) |", "|---|---|"]
        lines += [f"| {name} | {cost} |" for name, cost in off.items()]
    return "\n".join(lines)


def race_table(result: dict, equal: str) -> str:
    """The differences from canaryd: at equal requests (each mode at the same r) or at equal tokens (canaryd's
    best mode within the budget against each method's largest budget within it)."""
    if equal == "requests":
        lines = [
            "| r | canaryd mode | method | AUC(canaryd) − AUC(method) [95% CI] | reads |",
            "|---|---|---|---|---|",
        ]
        for x in result["equal_requests"]:
            lines.append(f"| {x['r']:g} | {x['ours']} | {x['peer']} | {x['diff']:+} | {x['verdict']} |")
    else:
        lines = [
            "| tokens ≤ | canaryd's mode (r) | method (r) | AUC(canaryd) − AUC(method) [CI] | reads |",
            "|---|---|---|---|---|",
        ]
        for x in result["equal_tokens"]:
            role = "best" if x["against"] == "best" else "shipped suite"
            lines.append(
                f"| {x['tokens']:,} | {role}: {x['ours']} ({x['ours_r']:g}) | {x['peer']} "
                f"({x['peer_r']:.3g}) | {x['diff']:+} | {x['verdict']} |"
            )
    return "\n".join(lines)


def tally(result: dict) -> str:
    """How the race reads, by verdict, against each peer at equal tokens (canaryd's best mode)."""
    out: dict[str, dict[str, int]] = {}
    for x in result["equal_tokens"]:
        if x["against"] != "best":
            continue
        out.setdefault(x["peer"], {}).setdefault(x["verdict"], 0)
        out[x["peer"]][x["verdict"]] += 1
    return "; ".join(
        f"{peer}: " + ", ".join(f"{v} {n}" for v, n in sorted(counts.items())) for peer, counts in out.items()
    )


def as_json(result: dict) -> dict:
    """The race with intervals as [value, low, high] and budgets as strings (JSON keys)."""

    def iv(x: Interval) -> list[float]:
        return [x.value, x.low, x.high]

    return {
        "per": {
            name: {
                f"{r:g}": {
                    "tokens": x["tokens"],
                    "auc": iv(x["auc"]),
                    "power": x["power"],
                    "false_alarms": {v: list(fa) for v, fa in x["false_alarms"].items()},
                    "raised": x["raised"],
                }
                for r, x in by_r.items()
            }
            for name, by_r in result["per"].items()
        },
        "equal_requests": [x | {"diff": iv(x["diff"])} for x in result["equal_requests"]],
        "equal_tokens": [x | {"diff": iv(x["diff"])} for x in result["equal_tokens"]],
    }
