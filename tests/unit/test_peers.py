"""The detection bench's peers (LT, MET, Token-DiFR): hand-computed statistics and rules, calibrated
nulls, power on shifts."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.peers import (
    LT_ABSOLUTE,
    LT_SIGMAS,
    PAD,
    difr_margin,
    difr_score,
    hamming_kernel,
    lt_matrix,
    lt_production_alarm,
    lt_statistic,
    lt_test,
    met_statistic,
    met_test,
    roc_auc,
)

ALPHA = 0.05
SEEDS = 300
# the rejection rate of a valid level-0.05 test over SEEDS independent nulls stays under this bound
# except with probability below 1e-4 (binomial tail, 3.8 standard errors)
BOUND = ALPHA + 3.8 * math.sqrt(ALPHA * (1 - ALPHA) / SEEDS)


# -- LT ----------------------------------------------------------------------------------------------------
def test_lt_imputes_a_missing_token_with_its_rows_minimum() -> None:
    m = lt_matrix([{"a": -1.0, "b": -2.0}, {"a": -1.5, "c": -3.0}])
    assert m.tolist() == [[-1.0, -2.0, -2.0], [-1.5, -3.0, -3.0]]


def test_lt_aligns_rows_of_the_same_tokens_and_of_others_in_the_order_tokens_first_appear() -> None:
    # rows 0 and 2 share their tokens in order (filled together), row 3 has them reversed, row 1 others
    rows = [{"a": -1.0, "b": -2.0}, {"b": -0.5, "c": -4.0}, {"a": -3.0, "b": -1.0}, {"b": -7.0, "a": -6.0}]
    assert lt_matrix(rows).tolist() == [
        [-1.0, -2.0, -2.0],
        [-4.0, -0.5, -4.0],
        [-3.0, -1.0, -3.0],
        [-6.0, -7.0, -7.0],
    ]


def test_lt_statistic_equals_its_hand_value() -> None:
    # union a, b, c; |Δ| = 0.5, 1, 1 (b and c imputed); mean 2.5/3
    s = lt_statistic([{"a": -1.0, "b": -2.0}], [{"a": -1.5, "c": -3.0}])
    assert s == pytest.approx(2.5 / 3)
    # two rows per window: means a −1 vs −2, b −2.5 vs −2.5 → (1 + 0) / 2
    two = lt_statistic(
        [{"a": -1.0, "b": -2.0}, {"a": -1.0, "b": -3.0}], [{"a": -2.0, "b": -2.0}, {"a": -2.0, "b": -3.0}]
    )
    assert two == pytest.approx(0.5)


def test_lt_identical_windows_give_zero_and_p_one() -> None:
    row = {"a": -0.1, "b": -2.5, "c": -4.0}
    t = lt_test([row] * 6, [row] * 6, permutations=199, rng=np.random.default_rng(0))
    assert t.statistic == 0.0
    assert t.p_value == 1.0


def _lt_rows(rng: np.random.Generator, n: int, shift: float) -> list[dict[str, float]]:
    base = np.array([-0.2, -1.8, -3.0, -4.5, -6.0])
    return [
        {f"t{i}": float(v) for i, v in enumerate(base + shift * np.arange(5) + rng.normal(0, 0.05, 5))}
        for _ in range(n)
    ]


def test_lt_null_rejects_at_most_alpha_and_p_values_are_uniform() -> None:
    ps = []
    for seed in range(SEEDS):
        rng = np.random.default_rng(seed)
        ps.append(lt_test(_lt_rows(rng, 10, 0.0), _lt_rows(rng, 10, 0.0), permutations=199, rng=rng).p_value)
    assert np.mean(np.array(ps) <= ALPHA) <= BOUND
    # uniform p-values: the mean is 1/2 within 4 standard errors (sd of U(0,1) is 0.289)
    assert abs(np.mean(ps) - 0.5) < 4 * 0.289 / math.sqrt(SEEDS)


def test_lt_rejects_a_clear_shift() -> None:
    rng = np.random.default_rng(1)
    t = lt_test(_lt_rows(rng, 10, 0.0), _lt_rows(rng, 10, 0.05), permutations=999, rng=rng)
    assert t.p_value <= 0.01


def test_lt_refuses_an_empty_window_or_row() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="both windows"):
        lt_test([], [{"a": -1.0}], rng=rng)
    with pytest.raises(ValueError, match="at least one logprob"):
        lt_statistic([{}], [{"a": -1.0}])


def test_lt_production_rule_against_hand_values() -> None:
    # history 0.1, 0.2, 0.3: mean 0.2, population sd √(0.02/3) = 0.08165 → 12σ bar at 1.1798 (the sample sd,
    # 0.1, would put it at 1.4 and spare 1.19)
    assert (LT_SIGMAS, LT_ABSOLUTE) == (12.0, 1.0)
    history = [0.1, 0.2, 0.3]
    assert not lt_production_alarm(history, 1.17)
    assert lt_production_alarm(history, 1.19)
    # 48 sd above a tight history, but not above the absolute 1.0: no alarm; past it: alarm
    assert not lt_production_alarm([0.01, 0.03], 0.5)
    assert lt_production_alarm([0.01, 0.03], 1.01)
    # a history without spread: any excess over its mean is infinitely many sd, still subject to 1.0
    assert lt_production_alarm([0.0] * 100, 1.5)
    assert not lt_production_alarm([0.0] * 100, 0.9)
    assert not lt_production_alarm([2.0] * 100, 2.0)
    with pytest.raises(ValueError, match="history"):
        lt_production_alarm([0.1], 5.0)


# -- Token-DiFR --------------------------------------------------------------------------------------------
# a hand-made sequence of three positions: (the verifier's logprobs, the provider's token)
SEQUENCE = [
    ({"a": -0.1, "b": -2.5, "c": -3.0}, "a"),  # the greedy token: margin 0
    ({"a": -1.0, "b": -0.5}, "a"),  # the runner-up: 0.5
    ({"x": -0.2, "y": -1.9}, "y"),  # 1.7
]


def test_difr_greedy_margin_on_a_hand_made_sequence() -> None:
    assert [difr_margin(lg, gold) for lg, gold in SEQUENCE] == pytest.approx([0.0, 0.5, 1.7])
    assert difr_score(SEQUENCE) == pytest.approx(2.2 / 3)
    # logits or logprobs alike: a constant per position leaves the margin as it is
    shifted = [({t: v + 7.0 for t, v in lg.items()}, gold) for lg, gold in SEQUENCE]
    assert difr_score(shifted) == pytest.approx(2.2 / 3)


def test_difr_seeded_gumbel_margin() -> None:
    logits, gumbels = {"a": -1.0, "b": -0.5}, {"a": 1.0, "b": 0.2}
    # T = 1: a −1 + 1 = 0, b −0.5 + 0.2 = −0.3: the seeded sampler picks a, whose margin is 0
    assert difr_margin(logits, "a", temperature=1.0, gumbels=gumbels) == pytest.approx(0.0)
    assert difr_margin(logits, "b", temperature=1.0, gumbels=gumbels) == pytest.approx(0.3)
    # T = 0.5: the noise is scaled by T, the logits are not divided by it: a −0.5, b −0.4
    assert difr_margin(logits, "a", temperature=0.5, gumbels=gumbels) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="Gumbel"):
        difr_margin(logits, "a", temperature=1.0)
    with pytest.raises(ValueError, match="not among"):
        difr_margin(logits, "z")


# -- MET ---------------------------------------------------------------------------------------------------
def test_hamming_kernel_pads_right_and_has_a_unit_diagonal() -> None:
    k = hamming_kernel([[1], [1, 2], [3, 4, 5, 6]], 3)
    assert np.diag(k).tolist() == [1.0, 1.0, 1.0]
    assert k[0, 1] == pytest.approx(2 / 3)  # [1, PAD, PAD] vs [1, 2, PAD]
    assert k[1, 2] == 0.0  # [3, 4, 5] (cut to 3) shares no position with [1, 2, PAD]
    assert PAD < 0


def test_met_statistic_equals_its_hand_value() -> None:
    # one completion per prompt and side: no within-sample pairs; cross terms 1/2 (p) and 1 (q), n = m = 2
    s1 = {"p": [[1, 2]], "q": [[1, 2]]}
    s2 = {"p": [[1, 3]], "q": [[1, 2]]}
    # the [1, 2] of prompt p and of prompt q would agree fully, but the kernel is blocked by prompt
    assert met_statistic(s1, s2, 2) == pytest.approx(-2 * 1.5 / 4)
    # two per side, one prompt: within pairs 1 (2 ordered pairs / 2·1), no cross agreement → 1 + 1 − 0
    assert met_statistic({"p": [[1, 2], [1, 2]]}, {"p": [[3, 4], [3, 4]]}, 2) == pytest.approx(2.0)


def _met_sample(rng: np.random.Generator, prompts: int, per: int, alphabet: list[int]) -> dict[str, list]:
    return {f"p{i}": [list(rng.choice(alphabet, size=6)) for _ in range(per)] for i in range(prompts)}


def test_met_null_rejects_at_most_alpha_and_p_values_are_uniform() -> None:
    ps = []
    for seed in range(SEEDS):
        rng = np.random.default_rng(seed)
        a = _met_sample(rng, 3, 5, [0, 1, 2])
        b = _met_sample(rng, 3, 5, [0, 1, 2])
        ps.append(met_test(a, b, 6, permutations=199, rng=rng).p_value)
    assert np.mean(np.array(ps) <= ALPHA) <= BOUND
    assert abs(np.mean(ps) - 0.5) < 4 * 0.289 / math.sqrt(SEEDS)


def test_met_rejects_a_clear_shift() -> None:
    rng = np.random.default_rng(2)
    a = _met_sample(rng, 3, 5, [0, 1])
    b = _met_sample(rng, 3, 5, [2, 3])
    t = met_test(a, b, 6, permutations=999, rng=rng)
    assert t.statistic > 0
    assert t.p_value <= 0.01


# MET's paper's settings: 25 prompts, 10 completions each per side, completions of 50 tokens
MET_PROMPTS, MET_PER, MET_L = 25, 10, 50


def _met_paper_sample(rng: np.random.Generator, weights: np.ndarray) -> dict[str, list]:
    """Completions of MET_L tokens (the first of each prompt 5 shorter, to exercise the padding) drawn
    from per-position token weights."""
    codes = rng.choice(len(weights), size=(MET_PROMPTS, MET_PER, MET_L), p=weights)
    return {
        f"p{i}": [list(c[: MET_L - 5]) if j == 0 else list(c) for j, c in enumerate(codes[i])]
        for i in range(MET_PROMPTS)
    }


def test_met_kernel_at_its_papers_settings() -> None:
    # 50 positions: 20 equal → 0.4; a 30-token completion against a 50-token one sharing those 30 → 0.6
    a, b = list(range(50)), list(range(20)) + [99] * 30
    k = hamming_kernel([a, b, a[:30]], MET_L)
    assert k[0, 1] == pytest.approx(0.4)
    assert k[0, 2] == pytest.approx(0.6)
    uniform = np.full(5, 0.2)
    ps = []
    for seed in range(100):
        rng = np.random.default_rng(seed)
        t = met_test(
            _met_paper_sample(rng, uniform), _met_paper_sample(rng, uniform), MET_L, permutations=99, rng=rng
        )
        ps.append(t.p_value)
    # a valid level-0.05 test over 100 nulls: above 0.05 + 3.8 standard errors with probability below 1e-4
    assert np.mean(np.array(ps) <= ALPHA) <= ALPHA + 3.8 * math.sqrt(ALPHA * (1 - ALPHA) / 100)
    # one token's share moves from 0.20 to 0.30: at 25 × 10 × 50 tokens a side, MET sees it
    rng = np.random.default_rng(7)
    moved = np.array([0.3, 0.175, 0.175, 0.175, 0.175])
    t = met_test(
        _met_paper_sample(rng, uniform), _met_paper_sample(rng, moved), MET_L, permutations=999, rng=rng
    )
    assert t.p_value <= 0.01


def test_met_needs_the_same_prompts_on_both_sides() -> None:
    with pytest.raises(ValueError, match="same prompts"):
        met_statistic({"p": [[1]]}, {"q": [[1]]}, 1)


# -- AUC ---------------------------------------------------------------------------------------------------
def test_roc_auc_counts_ties_half() -> None:
    assert roc_auc([2, 3], [1, 2]) == pytest.approx(3.5 / 4)
    assert roc_auc([(True, 1.0)], [(False, 9.0)]) == 1.0  # tuples compare in order
    assert roc_auc([1, 1], [1]) == 0.5
    assert math.isnan(roc_auc([], [1]))
