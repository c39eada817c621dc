"""The noise-targets bench's parts on known answers: the Clopper–Pearson interval, the series a week of
verdicts exports and what the shipped alert rules make of them (promtool), and a deployment of the scripted
kind that learns, stays quiet and catches a shift."""

from __future__ import annotations

import pytest

from bench.noise_targets import (
    Deployment,
    Row,
    _runs,
    alert_series,
    clopper_pearson,
    fired,
    first_drift,
    quiet,
    rate,
    scenarios,
)
from canaryd import log


@pytest.mark.parametrize(
    ("k", "n", "lo", "hi"),
    [
        (0, 10, 0.0, 1 - 0.025 ** (1 / 10)),  # 0.3085: (1 − hi)^n = α/2
        (10, 10, 0.025 ** (1 / 10), 1.0),
        (5, 10, 0.18709, 0.81291),  # the textbook values
        (0, 30_000, 0.0, 1.2296e-4),  # the "rule of three" region: ≈ 3.69/n
    ],
)
def test_clopper_pearson_on_hand_computed_values(k, n, lo, hi):
    got = clopper_pearson(k, n)
    assert got == pytest.approx((lo, hi), rel=1e-3, abs=1e-9)


def test_a_rate_prints_its_interval_per_unit():
    assert rate(0, 30_000, 1e4) == "0/30,000 = 0 [0, 1.2]"
    assert rate(0, 0) == "—"


def test_promtool_expanding_notation_and_the_exported_series():
    assert _runs(["1", "1", "1", "stale", "_", "_"]) == "1x2 stale _x1"
    passes = [{"a": "within-noise"}, {"a": "logprob-drift"}, {"a": "within-noise"}]
    series = {
        s["series"].split("verdict=")[-1]: s["values"] for s in alert_series(passes, [False] * 3, every=2)
    }
    assert series['"logprob-drift"}'] == "_x1 1x1 stale _"
    assert series['"within-noise"}'] == "1x1 stale _ 1x1"


def test_the_shipped_rules_fire_once_on_one_drifting_pass_and_never_on_quiet_ones(tmp_path):
    week = [{"a": "within-noise", "b": "identical"} for _ in range(12)]
    assert set(fired(week, [False] * 12, tmp_path).values()) == {(0, 0)}
    week[5] = {"a": "logprob-drift", "b": "identical"}
    alarm = [n == 5 for n in range(12)]
    got = fired(week, alarm, tmp_path)
    # a 5-minute pass is 5 scrapes; `for: 1m` leaves it firing for the last 4 of them
    assert got["CanarydLogprobDrift"] == (1, 4) and got["CanarydDriftEvidence"] == (1, 4)
    assert got["CanarydRegression"] == (0, 0)


def test_an_exact_deployment_learns_at_first_contact_stays_quiet_and_catches_a_shift_on_its_first_probe(
    tmp_path,
):
    log.configure("critical")
    dep = Deployment(tmp_path / "d", {}, seed=1)
    try:
        dep.learn()
        assert dep.learned == 1 and set(dep.regimes()) == {"exact"} and dep.learning_drift == 0
        row = Row("exact")
        quiet(row, dep, passes=4, seed=2)
        assert row.week.passes == 3 and row.week.drift == 0 and row.week.canary_passes == 3 * 13
        body, _ = scenarios({}, dep.cycle + 1)["-0.3"]
        shifted = dep.fork(tmp_path / "shifted", seed=3, body=body)
        assert first_drift([shifted.pass_()]) == 1
        shifted.close()
    finally:
        dep.close()
