"""Answers that flip learn too (docs/detection.md, "Answers that flip"), through the real `scripted` kind: a
provider without logprobs that flips between a few texts, and a logprob backend that flips at near ties,
are judged on their learned answer distribution (no drift, no regression over many passes); a new text or
a moved mix is caught; a canary wrong at an honest rate is no regression, and a rise of the rate is one.
The tests' statistics are pure functions, tested below on their own.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import structlog

from canaryd.judge import answers
from canaryd.judge.learning import Learning, is_learning
from canaryd.judge.stats import NoiseModel
from tests.harness.scripted_lab import change, scripted, verdicts

IDS = ["add", "capital", "colors"]
DRIFT = {"regression", "reference-mismatch", "answer-drift", "logprob-drift", "stack-change"}
API = {"noise_model": {"preset": "api"}, "logprobs": False}
TIES = {"noise_model": {"preset": "gpu-bf16", "ties": 0.6}}


def learned(lab, cid: str) -> Counter[str] | None:
    doc = lab.store.calibration("fake", cid)
    if doc is None or is_learning(doc):
        return None
    found = answers.learned(doc)
    return None if found is None else found[0]


def passes(lab, n: int) -> tuple[list[dict[str, str]], Counter[str]]:
    """n passes: each pass's verdicts, and every text answered. No part of a pass may fail (a failure is
    logged and the pass goes on, so only the log shows it: a text-only model once failed its refit check
    on every pass)."""
    seen, texts = [], Counter()
    with structlog.testing.capture_logs() as logs:
        for _ in range(n):
            run = lab.cycle()
            seen.append(verdicts(run))
            texts.update(r.observation.text for r in run.results)
    assert not [e for e in logs if e["log_level"] == "error"], [e["event"] for e in logs][:5]
    return seen, texts


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("settings", [API, TIES], ids=["api-text", "near-ties-logprobs"])
def test_honest_flipping_is_learned_and_never_drift_or_regression(make, seed, settings):
    lab = make(scripted(seed=seed, **settings))
    seen, texts = passes(lab, 25)
    found = {x for v in seen for x in v.values()}
    assert not DRIFT & found, [v for v in seen if DRIFT & set(v.values())]
    assert len(texts) > len(IDS)  # the answers did flip
    models = {c: learned(lab, c) for c in IDS}
    assert all(m is not None for m in models.values()), models  # learned within the 25 passes
    if settings is API:  # the text basis: the flips (wrong texts) are in the learned distribution
        assert any(
            len(m) > 1 and answers.wrong_count(m, lambda t: t in {"42", "Paris", " blue"})
            for m in models.values()
        )


def test_a_provider_without_logprobs_that_looks_exact_is_asked_learn_k_times_at_first_contact(make):
    lab = make(scripted(logprobs=False))
    lab.cycle()
    # five identical texts do not show an exact backend: first contact tops up to learn_k (24) answers
    models = [NoiseModel.from_dict(lab.store.calibration("fake", c)) for c in IDS]
    assert {(m.regime.value, m.k) for m in models} == {("exact", 24)}
    sent = lab.count_requests()
    assert set(verdicts(lab.cycle()).values()) == {"identical"} and len(sent) == len(IDS)


def test_a_text_never_seen_is_caught_within_a_few_passes(make):
    lab = make(scripted(seed=4, **API, body=change(at=26, canaries=["capital"], text="Paris!")))
    seen, _ = passes(lab, 25)
    assert not DRIFT & {x for v in seen for x in v.values()}
    after, _ = passes(lab, 6)
    caught = next(i for i, v in enumerate(after, 1) if v["capital"] in DRIFT)
    assert caught <= 6, after
    assert all(v["add"] not in DRIFT and v["colors"] not in DRIFT for v in after), after
    last = lab.store.observations(backend="fake", canary_id="capital", limit=1)[0]
    assert last.comparison["evidence"]["method"] in {"answer-distribution", "answer-rate"}


def test_a_moved_mix_of_answers_is_caught(make):
    # 76 % the script and 12 % each of two other texts; then only those two: no text is new, the mix
    # moved. One answer per pass is little evidence at the 1e-4 false-alarm bound, so this takes passes
    # (docs/detection.md: 9 to 21 over three seeds)
    flipped = {"preset": "api", "text_flips": 1.0}
    lab = make(scripted(seed=2, **API, body=change(at=31, canaries=["capital"], noise_model=flipped)))
    seen, _ = passes(lab, 30)
    assert not DRIFT & {x for v in seen for x in v.values()}
    after, texts = passes(lab, 30)
    assert texts["Paris"] == 0
    caught = [i for i, v in enumerate(after, 1) if v["capital"] in DRIFT]
    assert caught, after
    assert all(v["add"] not in DRIFT and v["colors"] not in DRIFT for v in after[: caught[0]]), after


def test_wrong_at_an_honest_rate_is_no_regression_and_a_rise_of_the_rate_is(make):
    lab = make(scripted(seed=1, noise=0.01, wrong_rate=0.2, body=change(at=31, wrong_rate=1.0)))
    seen, texts = passes(lab, 30)
    assert texts["wrong"] >= 6 and not DRIFT & {x for v in seen for x in v.values()}, seen
    assert all(answers.wrong_count(learned(lab, c), lambda t: t != "wrong") for c in IDS)
    after, _ = passes(lab, 12)
    for cid in IDS:
        assert any(v[cid] == "regression" for v in after), (cid, after)
    rows = lab.store.observations(backend="fake", limit=3)
    assert {r.comparison["evidence"]["method"] for r in rows if r.verdict == "regression"} == {"answer-rate"}


def test_a_first_wrong_answer_while_learning_is_asked_again(make):
    # always wrong from pass 3 on: the window holds no wrong answer, and the re-asks are wrong too
    lab = make(scripted(seed=1, noise=0.01, body=change(at=3, canaries=["add"], wrong_rate=1.0)))
    passes(lab, 2)
    assert is_learning(lab.store.calibration("fake", "add"))
    v = verdicts(lab.cycle())
    assert v["add"] == "regression", v
    reasons = lab.store.observations(backend="fake", canary_id="add", limit=1)[0].comparison["reasons"]
    assert any("asked again 4 times in this pass, wrong 4 times" in r for r in reasons), reasons


def test_a_regression_inside_a_learning_window_is_refused_at_the_fit():
    right = ["42"] * 12
    assert answers.window_problem(right + ["wrong"] * 12, lambda t: t == "42") is not None
    honest = random.Random(0).choices(["42", "wrong"], weights=[8, 2], k=24)
    assert answers.window_problem(honest, lambda t: t == "42") is None


def test_fisher_tails_are_exact():
    # all w new answers marked, none of k: one order of C(k + w, w)
    assert answers.more(6, 6, 0, 24) == pytest.approx(1 / math.comb(30, 6))
    assert answers.fewer(0, 4, 0, 24) == 1.0
    assert answers.more(0, 5, 3, 24) == 1.0


def test_the_tests_hold_their_false_alarm_bound_under_honest_flipping():
    """Honest answers (76 / 12 / 12 %, two of them wrong) against a learned window of 24: no answer-drift
    and no rate regression over 2,000 simulated canary-passes of 48 recent passes each (the bound is 1e-4
    per canary-pass: `bench/`-free, the expectation here is 0.2)."""
    rng = random.Random(7)
    check = {"a": True, "b": False, "c": False}.get
    fired = 0
    for _ in range(2000):
        draw = rng.choices("abc", weights=[76, 12, 12], k=24 + 48)
        texts = Counter(draw[:24])
        recent = [(t, True) for t in reversed(draw[24:])]
        shift = answers.distribution_shift(texts, recent)
        rate = answers.rate_rise(texts, recent, check)
        fired += bool(shift and shift.out) + bool(rate and rate.out)
    assert fired == 0


def test_a_learning_window_keeps_its_texts():
    state = Learning("h", (), (), 24, texts=("a", "b"))
    assert Learning.from_dict(state.as_dict()).texts == ("a", "b")
    old = state.as_dict()
    del old["learning"]["texts"]  # a window an older version began
    assert Learning.from_dict(old).texts == ()
