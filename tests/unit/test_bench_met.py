"""MET at its paper's settings in the detection bench (`bench.detection_met`): its trials on pools with known
answers, and the table's rates and AUC."""

from __future__ import annotations

import random

from bench.detection_met import MET_PROMPTS, MET_SAMPLES, MET_TOKENS, met_table, met_trials


def pool(rng: random.Random, vocab: str, n: int = 12) -> dict[str, list[tuple[str, ...]]]:
    return {p: [tuple(rng.choice(vocab) for _ in range(MET_TOKENS)) for _ in range(n)] for p in MET_PROMPTS}


def test_the_paper_settings():
    assert len(set(MET_PROMPTS)) >= 25 and MET_SAMPLES == 10 and MET_TOKENS >= 50


def test_one_distribution_is_quiet_and_another_alarms():
    rng = random.Random(0)
    base, same, other = pool(rng, "ab"), pool(rng, "ab"), pool(rng, "abc")
    quiet = met_trials(base, same, 20, 0.01, 199, rng)
    moved = met_trials(base, other, 20, 0.01, 199, rng)
    assert sum(a for a, _ in quiet) <= 2
    assert all(a for a, _ in moved) and max(p for _, p in moved) <= 0.01
    lines = met_table({"N0": quiet, "F": quiet, "G": moved}, ["G"], seed=0, resamples=200)
    # the honest fleet's alarms are false ones too; the AUC's negatives stay N0's
    assert lines[0].startswith("N0: false alarms") and lines[1].startswith("F: false alarms")
    assert lines[2].startswith("G: power 20/20")
    assert "ladder AUC (G vs N0): 1.000 [1.000, 1.000]" in lines[3]
