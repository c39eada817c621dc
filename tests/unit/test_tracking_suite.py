"""The shipped tracking suite (`canaries/tracking.toml`): LT's probe shape, one-token raw prompts, one token
out, top-20 logprobs, no expected answer, through the real `scripted` kind and the product's pass. It is
judged, learned and calibrated like any plain canary: quiet while it learns under the realistic GPU noise
model, then a −0.05 nat shift is drift and raises the backend's alarm."""

from __future__ import annotations

from pathlib import Path

import pytest

from canaryd.canaries import load_suite
from tests.harness.scripted_lab import ScriptedLab, change, scripted, verdicts

SUITE = Path(__file__).resolve().parents[2] / "canaries" / "tracking.toml"
DRIFT = {"regression", "reference-mismatch", "answer-drift", "logprob-drift", "stack-change"}


@pytest.fixture
def lab(tmp_path):
    made = ScriptedLab(
        tmp_path,
        scripted(noise_model={"preset": "gpu-bf16"}, seed=5, body=change(at=13, logprob_shift=-0.05)),
        {"tracking.toml": SUITE.read_text()},
    )
    yield made
    made.close()


def test_the_tracking_suite_is_lts_probe_shape_without_expected_answers():
    canaries = load_suite(SUITE).canaries
    assert len(canaries) >= 5
    for c in canaries:
        assert c.prompt is not None and len(c.prompt) == 1 and c.messages is None
        assert (c.decoding.max_tokens, c.decoding.top_logprobs, c.decoding.temperature) == (1, 20, 0.0)
        assert c.expect is None and c.continuation is None


def test_tracking_canaries_learn_quietly_under_gpu_noise_and_catch_a_small_shift(lab):
    ids = {c.id for c in lab.canaries()}
    first = lab.cycle()
    assert set(verdicts(first).values()) == {"baseline"}
    for r in first.results:
        assert len(r.observation.tokens) == 1 and len(r.observation.tokens[0].top) == 20
    learned = None
    for n in range(2, 13):
        run = lab.cycle()
        assert not DRIFT & set(verdicts(run).values()), (n, verdicts(run))
        assert not run.detector.alarm, n
        if learned is None and run.learning == ():
            learned = n
    assert learned is not None and learned <= 10, learned
    caught = [lab.cycle() for _ in range(3)]  # the shift, from the 13th pass on
    seen = [verdicts(run) for run in caught]
    assert any(set(v.values()) == {"logprob-drift"} for v in seen), seen
    assert set(verdicts(caught[-1])) == ids
    assert caught[-1].detector.alarm
