"""The published detectors canaryd is measured against, as pure functions: LT, MET and Token-DiFR.

These are competitors re-implemented for the detection bench, not canaryd features.

**LT**, Log Probability Tracking (Chauvin et al., ICLR 2026): a one-token prompt, ``max_tokens=1``,
top-20 logprobs, N requests per window. Each request is a row {token: logprob} over the returned top-k.
Over the union of the tokens seen in either window, a token missing from a row is imputed with that row's
smallest returned logprob (left censoring: it ranked below everything shown). The statistic is the mean,
over the union, of |mean logprob in window 1 − mean logprob in window 2|: an L1 distance between the
windows' mean vectors, divided by the union's size so that it does not grow with k. Its p-value comes from
permuting the 2N rows between the windows.

**MET**, Model Equality Testing (Gao, Liang, Guestrin, ICLR 2025): completions sampled at T = 1 for a set
of prompts, compared as two samples of (prompt, completion) pairs by the unbiased MMD² under the
prompt-blocked kernel k((x, y), (x', y')) = 1{x = x'} · Hamming(y, y') / L, where Hamming counts equal
positions of the two completions right-padded to L tokens (a unit diagonal). The p-value comes from
permutations that swap the two samples' labels within each prompt (the paper shows permutation and
simulated-null p-values give similar power).

**LT's production rule** (its repository's `lt_on_apis.py`, ``detect_changes``), what its authors run on
real APIs instead of the lab p-value: a test's statistic alarms when it lies more than 12 standard
deviations above the mean of the 100 statistics before it, leaving out the 48 (2 × 24 requests per test)
just before it, and exceeds 1.0 in absolute terms. (The repository then keeps one peak per 24 tests;
a single test's alarm is what the bench counts.) Its lab results rank detectors by the raw statistic
(`sampling/common.py`, ``AnalysisResult.auc``), not by the p-value.

**Token-DiFR** (Karvonen et al.; `difr/token_difr_vllm.py`, ``compute_margin_batch``): the verifier
re-runs the provider's tokens through its own copy of the model; per token, the margin is the largest
(Gumbel-noised) logit minus the provider's token's, where the noise is the sampler's own, reproduced from
the shared seed and scaled by the temperature, and the real logits are not divided by it. At T = 0 there is
no noise and the margin is the greedy margin, top-1 − token, which logprobs give as well as logits (they
differ by one constant per position). A score is the mean margin over a test's tokens. It reads tokens
only: the provider's reported logprobs play no part.

Both p-values are Monte-Carlo permutation p-values (1 + #{T_b ≥ T}) / (B + 1), valid at any B.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

Sample = Mapping[str, Sequence[Sequence[int]]]  # prompt → completions, each a sequence of token codes
PAD = -1  # the padding code of MET completions: equal pads count as agreeing positions, as in the paper


@dataclass(frozen=True, slots=True)
class PermutationTest:
    statistic: float
    p_value: float
    permutations: int


def _p_value(observed: float, permuted: np.ndarray) -> float:
    # a relative tolerance: a permutation equal to the observed split must count as "as extreme"
    tol = 1e-12 * max(1.0, abs(observed))
    return float((1 + np.count_nonzero(permuted >= observed - tol)) / (len(permuted) + 1))


# -- LT --------------------------------------------------------------------------------------------------
def lt_matrix(rows: Sequence[Mapping[str, float]]) -> np.ndarray:
    """The rows aligned by token over their union, a missing token imputed with its row's minimum."""
    if not rows or any(not r for r in rows):
        raise ValueError("LT: every row needs at least one logprob")
    # rows with the same tokens in the same order (most: one prompt's top-k) are filled together; per-row
    # numpy calls cost most of a test. The union's order is the rows' order of first appearance either way.
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(tuple(r), []).append(i)
    union: dict[str, int] = {}
    for tokens in groups:
        for t in tokens:
            union.setdefault(t, len(union))
    m = np.empty((len(rows), len(union)), dtype=np.float64)
    for tokens, at in groups.items():
        values = np.array([list(rows[i].values()) for i in at], dtype=np.float64)
        m[at] = values.min(axis=1)[:, None]
        m[np.ix_(at, [union[t] for t in tokens])] = values
    return m


def _lt_stat(m: np.ndarray, sums1: np.ndarray, n1: int) -> np.ndarray:
    """LT's statistic for each split given window 1's column sums (splits × tokens), window 1 of n1 rows
    and window 2 the rest of ``m``'s rows."""
    mean1 = sums1 / n1
    mean2 = (m.sum(axis=0) - sums1) / (len(m) - n1)
    return np.abs(mean1 - mean2).mean(axis=1)


def _lt_split_sums(m: np.ndarray, n1: int, permutations: int, rng: np.random.Generator) -> np.ndarray:
    """Window 1's column sums under random relabellings of the rows. Only the smaller side's rows are
    drawn (a relabelling is fixed by either side), so a long window costs little more than a short one."""
    small = min(n1, len(m) - n1)
    picked = np.argpartition(rng.random((permutations, len(m))), small - 1, axis=1)[:, :small]
    sums = m[picked].sum(axis=1)
    return sums if small == n1 else m.sum(axis=0) - sums


def lt_statistic(window1: Sequence[Mapping[str, float]], window2: Sequence[Mapping[str, float]]) -> float:
    """Mean over the token union of |mean logprob in window 1 − mean logprob in window 2|."""
    m = lt_matrix([*window1, *window2])
    n1 = len(window1)
    return float(_lt_stat(m, m[:n1].sum(axis=0, keepdims=True), n1)[0])


def lt_test(
    window1: Sequence[Mapping[str, float]],
    window2: Sequence[Mapping[str, float]],
    *,
    permutations: int = 999,
    rng: np.random.Generator,
) -> PermutationTest:
    """LT's statistic and its permutation p-value over the 2N pooled rows."""
    if not window1 or not window2:
        raise ValueError("LT: both windows need at least one row")
    m = lt_matrix([*window1, *window2])
    n1 = len(window1)
    observed = float(_lt_stat(m, m[:n1].sum(axis=0, keepdims=True), n1)[0])
    permuted = _lt_stat(m, _lt_split_sums(m, n1, permutations, rng), n1)
    return PermutationTest(observed, _p_value(observed, permuted), permutations)


# LT's production detector (lt_on_apis.py): its constants
LT_SIGMAS = 12.0
LT_HISTORY = 100
LT_EXCLUDED = 48
LT_ABSOLUTE = 1.0


def lt_production_alarm(history: Sequence[float], statistic: float) -> bool:
    """LT's production rule for one test: ``history`` is the LT_HISTORY statistics of the tests before it,
    the LT_EXCLUDED nearest already left out. It alarms when the statistic lies more than LT_SIGMAS
    (population) standard deviations above their mean, a zero spread counting any excess as infinitely
    many, and exceeds LT_ABSOLUTE."""
    if len(history) < 2:
        raise ValueError("LT production rule: needs a history of at least two statistics")
    h = np.asarray(history, dtype=np.float64)
    mean, std = float(h.mean()), float(h.std())
    above = statistic > mean if std == 0 else (statistic - mean) / std > LT_SIGMAS
    return bool(above and statistic > LT_ABSOLUTE)


# -- Token-DiFR ------------------------------------------------------------------------------------------
def difr_margin(
    logits: Mapping[str, float],
    gold: str,
    *,
    temperature: float = 0.0,
    gumbels: Mapping[str, float] | None = None,
) -> float:
    """Token-DiFR's margin at one position: max over tokens of (logit + temperature · gumbel) minus the
    provider's token's own, from the verifier's logits (or logprobs) over the tokens it returned; the
    provider's token must be among them. ``gumbels``: the sampler's noise per token, reproduced from the
    shared seed (needed when temperature > 0)."""
    if gold not in logits:
        raise ValueError(f"Token-DiFR: the provider's token {gold!r} is not among the verifier's logits")
    if temperature > 0 and gumbels is None:
        raise ValueError("Token-DiFR: a temperature above 0 needs the seeded sampler's Gumbel noise")
    noised = {t: v + (temperature * gumbels[t] if temperature > 0 else 0.0) for t, v in logits.items()}
    return max(noised.values()) - noised[gold]


def difr_score(positions: Sequence[tuple[Mapping[str, float], str]], **kw) -> float:
    """The mean margin over a sequence of (verifier logits, provider's token) positions."""
    if not positions:
        raise ValueError("Token-DiFR: no token to score")
    return float(np.mean([difr_margin(lg, gold, **kw) for lg, gold in positions]))


# -- MET -------------------------------------------------------------------------------------------------
def hamming_kernel(completions: Sequence[Sequence[int]], length: int) -> np.ndarray:
    """Hamming similarity of completions right-padded (or cut) to ``length`` codes, over ``length``."""
    if length < 1:
        raise ValueError("MET: completion length must be at least 1")
    x = np.full((len(completions), length), PAD, dtype=np.int64)
    for i, c in enumerate(completions):
        c = list(c)[:length]
        x[i, : len(c)] = c
    return (x[:, None, :] == x[None, :, :]).sum(axis=2) / length


def _met_stat(blocks: Sequence[np.ndarray], labels: Sequence[np.ndarray], n: int, m: int) -> np.ndarray:
    """Unbiased MMD² for each labelling (rows of each block's boolean matrix: True = sample 1).

    The kernel is zero across prompts, so the sums run within each prompt's block; n and m are the two
    samples' total sizes, which set the normalisers as in the pooled statistic."""
    xx = yy = xy = 0.0
    for k, lab in zip(blocks, labels, strict=True):
        a = lab.astype(np.float64)
        b = 1.0 - a
        diag = np.diag(k)
        xx = xx + ((a @ k) * a).sum(axis=1) - a @ diag
        yy = yy + ((b @ k) * b).sum(axis=1) - b @ diag
        xy = xy + ((a @ k) * b).sum(axis=1)
    within_x = xx / (n * (n - 1)) if n > 1 else 0.0
    within_y = yy / (m * (m - 1)) if m > 1 else 0.0
    return within_x + within_y - 2 * xy / (n * m)


def _met_blocks(
    sample1: Sample, sample2: Sample, length: int
) -> tuple[list[np.ndarray], list[np.ndarray], int, int]:
    if set(sample1) != set(sample2):
        raise ValueError("MET: both samples need completions for the same prompts")
    blocks, labels = [], []
    for prompt in sample1:
        c1, c2 = list(sample1[prompt]), list(sample2[prompt])
        blocks.append(hamming_kernel([*c1, *c2], length))
        labels.append(np.arange(len(c1) + len(c2)) < len(c1))
    n = sum(len(s) for s in sample1.values())
    m = sum(len(s) for s in sample2.values())
    if n < 1 or m < 1:
        raise ValueError("MET: both samples need at least one completion")
    return blocks, labels, n, m


def met_statistic(sample1: Sample, sample2: Sample, length: int) -> float:
    """MET's unbiased MMD² with the prompt-blocked Hamming kernel; completions as token-code sequences."""
    blocks, labels, n, m = _met_blocks(sample1, sample2, length)
    return float(_met_stat(blocks, [lab[None, :] for lab in labels], n, m)[0])


def met_test(
    sample1: Sample,
    sample2: Sample,
    length: int,
    *,
    permutations: int = 999,
    rng: np.random.Generator,
) -> PermutationTest:
    """MET's statistic and its p-value from label permutations within each prompt."""
    blocks, labels, n, m = _met_blocks(sample1, sample2, length)
    observed = float(_met_stat(blocks, [lab[None, :] for lab in labels], n, m)[0])
    permuted = _met_stat(
        blocks, [rng.permuted(np.tile(lab, (permutations, 1)), axis=1) for lab in labels], n, m
    )
    return PermutationTest(observed, _p_value(observed, permuted), permutations)


# -- scoring a detector ------------------------------------------------------------------------------------
def roc_auc(positives: Sequence, negatives: Sequence) -> float:
    """P(score of a changed server > score of an honest one), ties counted half (Mann–Whitney).

    Scores only need to be comparable (floats, or tuples compared in order)."""
    if not positives or not negatives:
        return float("nan")
    wins = sum((p > q) + 0.5 * (p == q) for p in positives for q in negatives)
    return wins / (len(positives) * len(negatives))
