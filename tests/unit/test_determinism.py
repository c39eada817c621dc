"""Deterministic modes are watched (docs/detection.md, "Deterministic modes"), through the real `scripted`
kind: a backend whose stack declares vLLM's batch invariance or SGLang's deterministic inference is never
learning; its first non-exact probe, at first contact or against its exact model, is ``determinism-broken``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from canaryd.backends.sglang import server_info_fields
from canaryd.judge.determinism import SGLANG_FIELD, VLLM_FIELD, declared
from canaryd.judge.learning import Learning, is_learning
from canaryd.judge.stats import NoiseModel
from canaryd.judge.verdicts import Verdict
from tests.harness.scripted_lab import change, scripted, verdicts

IDS = ["add", "capital", "colors"]
BATCH_INVARIANT = {VLLM_FIELD: "1"}
# vLLM's batch-invariant mode with its measured residual (up to 6.7e-2 nats) on a few paths; the seed pins
# the draws, as a chance of ~1/70 a canary has first contact on one path alone would otherwise make it exact
INVARIANT = {"preset": "batch-invariant"}
SEED = 7
SERVER_INFO = Path(__file__).parents[1] / "fixtures" / "engines" / "sglang" / "server_info.json"


def sglang_stack(deterministic: bool) -> dict[str, str]:
    """The stack fields of the recorded SGLang ``/server_info`` body, its deterministic flag set as given."""
    doc = json.loads(SERVER_INFO.read_text())["body"]
    doc["enable_deterministic_inference"] = deterministic
    return server_info_fields(doc)


def test_the_modes_are_read_from_the_fields_the_kinds_record():
    assert declared(BATCH_INVARIANT) is not None and declared({VLLM_FIELD: "0"}) is None
    assert declared({VLLM_FIELD: "true"}) is None  # vLLM reads an integer: this one would not start
    assert declared(sglang_stack(False)) is None  # the recorded body: the flag off, under this name
    mode = declared(sglang_stack(True))
    assert mode is not None and mode.field == SGLANG_FIELD and "sglang#10785" in mode.gaps
    assert "this server runs tp_size 1" in mode.gaps  # the recorded server's, next to the TP >= 4 gap


def test_a_batch_invariant_backend_that_is_not_exact_is_broken_at_first_contact_not_learning(make):
    lab = make(scripted(stack=BATCH_INVARIANT, noise_model=INVARIANT, seed=SEED))
    run = lab.cycle()
    assert set(verdicts(run).values()) == {"determinism-broken"} and run.learning == ()
    assert Verdict.DETERMINISM_BROKEN.is_drift
    reason = run.results[0].comparison.reasons[0]
    assert "vLLM batch invariance (env.VLLM_BATCH_INVARIANT=1)" in reason, reason
    assert "first-contact probes" in reason and "vllm#42960" in reason
    for c in IDS:  # the pass's answer is still the baseline; the window is refused, never learned
        assert lab.store.baseline("fake", c) is not None
        doc = lab.store.calibration("fake", c)
        assert is_learning(doc) and "held to exactness" in Learning.from_dict(doc).refused
    again = lab.cycle()
    assert set(verdicts(again).values()) == {"determinism-broken"} and again.learning == ()
    assert all(r.comparison.correct for r in again.results)


def test_the_same_noise_without_the_mode_is_learning(make):
    lab = make(scripted(noise_model=INVARIANT, seed=SEED))
    assert set(verdicts(lab.cycle()).values()) == {"baseline"}
    assert set(verdicts(lab.cycle()).values()) <= {"learning", "identical"}


def test_an_exact_deterministic_backend_keeps_one_probe_detection_as_determinism_broken(make):
    body = change(at=3, noise_model=INVARIANT)  # its batch invariance breaks at pass 3
    lab = make(scripted(stack=BATCH_INVARIANT, seed=SEED, body=body))
    assert set(verdicts(lab.cycle()).values()) == {"baseline"}
    assert {NoiseModel.from_dict(lab.store.calibration("fake", c)).regime.value for c in IDS} == {"exact"}
    assert set(verdicts(lab.cycle()).values()) == {"identical"}
    run = lab.cycle()
    assert set(verdicts(run).values()) == {"determinism-broken"}
    assert all("left the exact model" in r.comparison.reasons[0] for r in run.results)


def test_a_wrong_answer_stays_a_regression(make):
    body = change(at=2, canaries=["add"], text="41")
    lab = make(scripted(stack=BATCH_INVARIANT, noise_model=INVARIANT, seed=SEED, body=body))
    lab.cycle()
    v = verdicts(lab.cycle())
    assert v == {"add": "regression", "capital": "determinism-broken", "colors": "determinism-broken"}


def test_sglang_deterministic_inference_from_its_recorded_server_info(make):
    lab = make(scripted(stack=sglang_stack(True), noise_model=INVARIANT, seed=SEED))
    run = lab.cycle()
    assert set(verdicts(run).values()) == {"determinism-broken"}
    assert "SGLang deterministic inference" in run.results[0].comparison.reasons[0]


@pytest.mark.parametrize("seed", [SEED, 8])
def test_baseline_calibrate_accepts_the_noise(make, seed):
    # at these seeds a baseline takes a route (path × cache state) none of calibrate's first K probes takes:
    # its second look, K more alone, finds it
    lab = make(scripted(stack=BATCH_INVARIANT, noise_model=INVARIANT, seed=seed))
    lab.cycle()
    p = lab.cli("baseline", "calibrate")
    assert p.returncode == 0, p.stdout + p.stderr
    assert set(verdicts(lab.cycle()).values()) <= {"within-noise", "identical"}


def test_a_fleet_members_first_answer_is_its_configurations_baseline_when_broken(make):
    # two servers of one fleet, each its own configuration: a member's first answer to a canary is found
    # broken at its own first contact, and still becomes that configuration's baseline
    fleet = "".join(f'[[backends.fleet]]\nname = "{m}"\nfingerprint = "fp-{m}"\n' for m in ("a", "b"))
    lab = make(scripted(stack=BATCH_INVARIANT, noise_model=INVARIANT, seed=SEED, body=fleet))
    # which member answers a request follows the order the canaries' threads draw in: cycle until every
    # canary has met both (4 cycles when the machine is idle; a loaded one may need a few more)
    seen = [verdicts(lab.cycle()) for _ in range(4)]
    while len(seen) < 12 and not all(len(lab.store.baselines("fake", c)) == 2 for c in IDS):
        seen.append(verdicts(lab.cycle()))
    # first contact probes until each member's configuration has its own evidence, so a member's first
    # answer is broken at once (new-configuration only where a round never reached it)
    found = {v for pass_ in seen for v in pass_.values()}
    assert "determinism-broken" in found and found <= {"determinism-broken", "new-configuration"}, seen
    assert all(len(lab.store.baselines("fake", c)) == 2 for c in IDS)
    verdict_of = {o.id: o.verdict for c in IDS for o in lab.store.observations(backend="fake", canary_id=c)}
    first = [verdict_of[b.observation_id] for c in IDS for b in lab.store.baselines("fake", c).values()]
    assert first.count("determinism-broken") >= 4, first  # each member's first answer, found at once
