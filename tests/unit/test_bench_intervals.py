"""The detection bench's intervals: the bootstrap interval of an AUC covers the true AUC about as often
as it claims, a paired difference of equal methods is a tie, Clopper–Pearson bounds match known values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.detection_methods import TRACKING_ROW, Outcome
from bench.detection_peers import LT
from bench.detection_race import per_method_table, race, race_table, refit_probes, tally
from bench.detection_report import figures, targets
from bench.intervals import Interval, auc_difference, auc_interval, clopper_pearson, rate, verdict
from bench.peers import roc_auc


def test_the_auc_interval_covers_the_true_auc_at_its_level() -> None:
    # changed-server scores N(δ, 1) against honest N(0, 1): the true AUC is Φ(δ/√2)
    delta, n, reps = 0.8, 60, 200
    truth = 0.5 * (1 + math.erf(delta / 2))
    rng = np.random.default_rng(0)
    covered = 0
    for i in range(reps):
        pos, neg = list(rng.normal(delta, 1, n)), list(rng.normal(0, 1, n))
        iv = auc_interval(pos, neg, rng=rng, resamples=200)
        if i < 3:  # the point estimate is the Mann–Whitney AUC
            assert iv.value == pytest.approx(roc_auc(pos, neg))
        covered += iv.low <= truth <= iv.high
    # 95% claimed; the percentile bootstrap at n = 60 runs a little under it. Over 200 replications the
    # rate lies within ±4.6 standard errors of 0.95 except with negligible probability
    assert 0.88 <= covered / reps <= 0.995


def test_the_interval_ranks_tuples_and_counts_ties_half() -> None:
    rng = np.random.default_rng(1)
    iv = auc_interval([(True, 1.0), (False, 2.0)], [(False, 2.0), (False, 0.5)], rng=rng, resamples=50)
    assert iv.value == pytest.approx(roc_auc([(True, 1.0), (False, 2.0)], [(False, 2.0), (False, 0.5)]))
    assert iv.low <= iv.value <= iv.high


def test_a_paired_difference_of_one_method_with_itself_is_a_tie_and_a_better_one_is_ahead() -> None:
    rng = np.random.default_rng(2)
    pos, neg = list(rng.normal(0.5, 1, 200)), list(rng.normal(0, 1, 200))
    same = auc_difference((pos, neg), (pos, neg), rng=rng, resamples=200)
    assert (same.value, same.low, same.high) == (0.0, 0.0, 0.0)
    assert verdict(same) == "tie"
    sharper = [p + 1.5 for p in pos]  # the same trials, each scored further from the honest ones
    d = auc_difference((sharper, neg), (pos, neg), rng=rng, resamples=200)
    assert d.low > 0.1
    assert verdict(d) == "ahead"
    assert verdict(auc_difference((pos, neg), (sharper, neg), rng=rng, resamples=200)) == "behind"


def test_a_difference_inside_its_margin_reads_as_a_tie() -> None:
    assert verdict(Interval(0.02, 0.011, 0.03), margin=0.01) == "ahead"
    assert verdict(Interval(-0.005, -0.02, 0.01), margin=0.01) == "tie"
    assert verdict(Interval(-0.015, -0.019, -0.011), margin=0.01) == "behind"
    assert verdict(Interval(-0.009, -0.009, -0.009), margin=0.01) == "tie"  # a loss within the tolerance
    assert verdict(Interval(math.nan, math.nan, math.nan)) == "n/a"
    assert f"{Interval(0.01, -0.02, 0.04):+}" == "+0.010 [-0.020, +0.040]"


def test_clopper_pearson_against_known_values() -> None:
    assert clopper_pearson(0, 800) == pytest.approx((0.0, 1 - 0.025 ** (1 / 800)))
    assert clopper_pearson(100, 100) == pytest.approx((0.025 ** (1 / 100), 1.0))
    # binom.test(5, 100) in R: 0.01643187 0.11283491
    assert clopper_pearson(5, 100) == pytest.approx((0.01643187, 0.11283491), abs=1e-7)
    assert rate(0, 369) == "0/369 (≤ 0.010)"
    with pytest.raises(ValueError, match="hits"):
        clopper_pearson(3, 2)


def test_the_race_sets_each_method_at_its_largest_budget_within_canaryds_tokens() -> None:
    """At equal tokens LT (2 tokens a request) gets the window whose tokens fit canaryd's test, and the
    difference from canaryd's best mode within the budget carries its verdict."""
    rng = np.random.default_rng(3)

    def outcomes(perfect: bool, changed: bool, n: int = 40) -> list[Outcome]:
        return [
            Outcome(perfect and changed, float(changed) if perfect else float(rng.normal())) for _ in range(n)
        ]

    cells: dict = {}
    for name, rs, perfect in (
        ("canaryd", (1, 2), True),
        ("canaryd teacher-forced", (1, 2), False),
        (LT, (1, 2, 10 / 6, 16 / 6, 49), False),
    ):
        for variant in ("N0", "Q1"):
            cells[(name, variant)] = {r: outcomes(perfect, variant != "N0") for r in rs}
    tokens = {"canaryd": 98.0, "canaryd teacher-forced": 16 / 6, LT: 2.0}
    result = race(cells, ["Q1"], 6, tokens, seed=0, resamples=100)
    at = {(x["tokens"], x["peer"]): x for x in result["equal_tokens"]}
    # canaryd's budgets: 588 and 1,176 (chat), 16 and 32 (teacher-forced)
    assert sorted({x["tokens"] for x in result["equal_tokens"]}) == [16, 32, 588, 1176]
    assert at[(32, LT)]["peer_r"] == 16 / 6 and at[(16, LT)]["peer_r"] == 1  # 32 and 12 tokens
    assert at[(588, LT)]["peer_r"] == 49 and at[(1176, LT)]["peer_r"] == 49
    assert at[(588, LT)]["ours"] == "canaryd" and at[(588, LT)]["verdict"] == "ahead"
    # at equal requests each mode meets LT at the same r
    assert {(x["r"], x["ours"]) for x in result["equal_requests"]} == {
        (r, m) for r in (1, 2) for m in ("canaryd", "canaryd teacher-forced")
    }
    assert result["per"]["canaryd"][1]["false_alarms"]["N0"][:2] == (0, 40)


def test_false_alarms_are_counted_by_the_rule_that_raised_them() -> None:
    """A detector's honest alarms are told apart by path (one cycle can meet two rules); the table says so."""
    quiet = [Outcome(False, 0.0)] * 95
    loud = [Outcome(True, 1.0, raised=("min-out",))] * 3 + [Outcome(True, 1.0, raised=("e-cusum", "min-out"))]
    cells = {
        ("canaryd", "N0"): {1: quiet + loud + [Outcome(True, 1.0, raised=("e-cusum",))]},
        ("canaryd", "Q1"): {1: [Outcome(True, 1.0, raised=("min-out",))] * 100},
    }
    result = race(cells, ["Q1"], 6, {"canaryd": 98.0}, seed=0, resamples=50)
    x = result["per"]["canaryd"][1]
    assert x["false_alarms"]["N0"][:2] == (5, 100)
    assert x["raised"]["N0"] == {"min-out": 4, "e-cusum": 2}
    assert "N0 5/100 (≤ 0.113, by e-cusum 2, min-out 4)" in per_method_table(result)


def test_a_detectors_refit_probes_are_requests_of_its_test_in_its_tokens_and_its_cost() -> None:
    """The probes a detector row's refits sent (`Outcome.refit_probes`) count in its tokens per test, at
    equal tokens and in the budget for power 0.95, beside its C·r; a peer's outcomes carry none."""
    cells = {
        (TRACKING_ROW, "N0"): {1: [Outcome(False, 0.0, refit_probes=3)] * 10 + [Outcome(False, 0.0)] * 10},
        (TRACKING_ROW, "Q1"): {1: [Outcome(True, 1.0, refit_probes=2)] * 20},
        (LT, "N0"): {1: [Outcome(False, 0.0)] * 20},
        (LT, "Q1"): {1: [Outcome(True, 1.0)] * 20},
    }
    assert (
        refit_probes(cells, TRACKING_ROW, 1) == 70 / 40 and refit_probes(cells, TRACKING_ROW, 1, ["Q1"]) == 2
    )
    result = race(cells, ["Q1"], 6, {TRACKING_ROW: 2.0, LT: 2.0}, seed=0, resamples=50)
    assert (
        result["per"][TRACKING_ROW][1]["tokens"] == (6 + 70 / 40) * 2 and result["per"][LT][1]["tokens"] == 12
    )
    assert "| canaryd tracking | 1 | 16 (1.75) |" in per_method_table(result)
    figs = figures(cells, ["Q1"], 6, {TRACKING_ROW: 2.0, LT: 2.0})
    assert figs["methods"][TRACKING_ROW]["ladder_power_095"] == {"r": 1, "requests": 8, "tokens": 16}
    assert figs["methods"][LT]["ladder_power_095"] == {"r": 1, "requests": 6, "tokens": 12}


def test_at_equal_tokens_each_peer_also_meets_the_shipped_suite_where_another_mode_is_best() -> None:
    """canaryd's best mode within a budget races every peer; where that is not the shipped default suite,
    the shipped suite (where it fits the budget) races it as well, on its own row."""
    rng = np.random.default_rng(4)

    def outcomes(perfect: bool, changed: bool, n: int = 40) -> list[Outcome]:
        return [Outcome(False, float(changed) if perfect else float(rng.normal())) for _ in range(n)]

    cells: dict = {}
    for name, rs, perfect in (
        ("canaryd", (1, 2), False),
        (TRACKING_ROW, (1, 2, 49, 98), True),
        (LT, (1, 2, 49, 98), False),
    ):
        for variant in ("N0", "Q1"):
            cells[(name, variant)] = {r: outcomes(perfect, variant != "N0") for r in rs}
    tokens = {"canaryd": 98.0, TRACKING_ROW: 2.0, LT: 2.0}
    result = race(cells, ["Q1"], 6, tokens, seed=0, resamples=100)
    at = {(x["tokens"], x["against"], x["peer"]): x for x in result["equal_tokens"]}
    assert at[(12, "best", LT)]["ours"] == TRACKING_ROW and (12, "shipped", LT) not in at  # 588 tok: no fit
    best, shipped = at[(588, "best", LT)], at[(588, "shipped", LT)]
    assert (best["ours"], best["ours_r"], best["peer_r"]) == (TRACKING_ROW, 49, 49)
    assert (shipped["ours"], shipped["ours_r"], shipped["peer_r"]) == ("canaryd", 1, 49)
    assert best["verdict"] == "ahead" and shipped["verdict"] == "tie"  # both random there
    assert "shipped suite: canaryd (1)" in race_table(result, "tokens")
    assert tally(result) == f"{LT}: ahead {len([x for x in at if x[1] == 'best'])}"
    shipped_rows = len([x for x in at if x[1] == "shipped"])
    lines = targets({"methods": {}, "cells": {}}, {}, {}, 6, 4.0, 0.01, result)
    assert (
        f"canaryd's shipped suite (where not the best mode) against {LT}: 0 ahead, {shipped_rows} tie"
        in "\n".join(lines)
    )
