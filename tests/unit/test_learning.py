"""Learning by default (docs/detection.md, "Learning by default"), through the real `scripted` kind: a noisy
backend learns each canary's noise over its first passes without a drift verdict and then catches a shift;
an exact one is found exact at first contact and keeps one-probe detection; what is not noise (a stack
change, a wrong answer) is reported while learning; ``learn = false`` keeps the judgement at tolerance 0;
and the daemon raises no drift verdict or alarm while it learns.
"""

from __future__ import annotations

import time

from canaryd.config import load_config
from canaryd.daemon.service import Daemon
from canaryd.judge.learning import Learning, is_learning
from canaryd.judge.stats import NoiseModel
from tests.harness.scripted_lab import ScriptedLab, change, free_port, scripted, verdicts
from tests.harness.suites import PLAIN

IDS = ["add", "capital", "colors"]
LEARNED_BY = 8  # the defaults: 5 probes at first contact (its answer too), then 3 a pass, until 24
DRIFT = {"regression", "reference-mismatch", "answer-drift", "logprob-drift", "stack-change"}


def regime(lab: ScriptedLab, cid: str) -> str | None:
    """What the store holds for the canary: ``learning`` (a window), a model's regime, or None."""
    doc = lab.store.calibration("fake", cid)
    if doc is None:
        return None
    return "learning" if is_learning(doc) else NoiseModel.from_dict(doc).regime.value


def window(lab: ScriptedLab, cid: str) -> Learning:
    return Learning.from_dict(lab.store.calibration("fake", cid))


def test_a_noisy_backend_learns_within_ten_passes_without_drift_and_then_catches_a_shift(make):
    lab = make(scripted(noise=0.01, body=change(at=13, logprob_shift=-0.3)))
    seen, learned = [], None
    for n in range(1, 13):
        run = lab.cycle()
        v = verdicts(run)
        seen.append(v)
        assert not DRIFT & set(v.values()), (n, v)
        if learned is None and run.learning == ():
            learned = n
            assert {regime(lab, c) for c in IDS} <= {"continuous", "modal"}
        elif learned is None:
            assert set(run.learning) == set(IDS) and all(regime(lab, c) == "learning" for c in IDS), n
    # the end of pass 8, or 9 when the pass that filled a window lay out of the noise before it
    assert learned in (LEARNED_BY, LEARNED_BY + 1), learned
    assert set(seen[0].values()) == {"baseline"}
    assert {x for v in seen[1:learned] for x in v.values()} <= {"learning", "identical"}
    assert "learning" in {x for v in seen[1:learned] for x in v.values()}
    assert {x for v in seen[learned:] for x in v.values()} <= {"within-noise", "identical"}

    # the learning verdict carries its progress, in the reasons and the evidence
    rows = lab.store.observations(backend="fake", canary_id="add", limit=100)
    learning = [o for o in rows if o.verdict == "learning"]
    assert learning and all("learning this canary's noise" in o.comparison["reasons"][0] for o in learning)
    assert {o.comparison["evidence"]["method"] for o in learning} == {"learning"}

    caught = [verdicts(lab.cycle()) for _ in range(2)]  # the shift, from the 13th pass on
    assert any(set(v.values()) == {"logprob-drift"} for v in caught), caught


def test_an_exact_backend_is_found_exact_at_first_contact_and_a_shift_is_caught_on_its_first_probe(make):
    lab = make(scripted(body=change(at=2, logprob_shift=-0.01)))
    sent = lab.count_requests()
    run = lab.cycle()
    assert set(verdicts(run).values()) == {"baseline"} and run.learning == ()
    assert {regime(lab, c) for c in IDS} == {"exact"}
    # first contact: 2 alone and 2 crowded (a batch of the backend's concurrency, 4) beside each answer
    assert len(sent) == len(IDS) * (1 + 2 + 2 * 4)
    del sent[:]
    assert set(verdicts(lab.cycle()).values()) == {"logprob-drift"}
    assert len(sent) == len(IDS)  # an exact canary sends nothing more


def test_while_learning_a_stack_change_and_a_wrong_answer_are_reported(make):
    body = change(at=3, stack={"engine.dtype": "bfloat16"}) + change(at=3, canaries=["add"], text="41")
    lab = make(scripted(noise=0.01, body=body))
    assert set(verdicts(lab.cycle()).values()) == {"baseline"}
    assert set(verdicts(lab.cycle()).values()) <= {"learning", "identical"}
    v = verdicts(lab.cycle())
    assert v == {"add": "regression", "capital": "stack-change", "colors": "stack-change"}
    before = window(lab, "capital").k
    lab.cycle()  # a pass with drift adds nothing to the window (and counts as a pass)
    assert window(lab, "capital").k == before and window(lab, "capital").passes == 4


def test_learn_false_keeps_tolerance_zero(make):
    lab = make(scripted(noise=0.01), tail="[compare]\nlearn = false\n")
    sent = lab.count_requests()
    lab.cycle()
    assert set(verdicts(lab.cycle()).values()) == {"logprob-drift"}
    assert len(sent) == 2 * len(IDS) and all(regime(lab, c) is None for c in IDS)


def test_a_window_that_would_launder_a_change_restarts_once_and_then_is_refused(make):
    # the shift lands at the end of the first window (a split in time), and the second window holds only
    # the shifted noise (the baseline lies outside it): neither may become the model
    tail = "[compare]\nlearn_k = 10\nlearn_per_pass = 1\n"
    lab = make(scripted(noise=0.01, body=change(at=4, logprob_shift=-0.3)), tail=tail)
    seen = [verdicts(lab.cycle()) for _ in range(14)]
    states = [window(lab, c) for c in IDS]
    assert all(s.refused and "learning refused" in s.reason() for s in states), [s.reason() for s in states]
    assert all(s.restarts == 1 for s in states)
    # while it learned, the shift was learning; refused, it is drift at tolerance 0, and says why
    assert {x for v in seen[:6] for x in v.values()} <= {"baseline", "learning", "identical"}
    last = lab.cycle()
    assert set(verdicts(last).values()) == {"logprob-drift"} and last.learning == ()
    assert any("learning refused" in r for r in last.results[0].comparison.reasons)


def test_baseline_calibrate_finishes_learning_in_one_go(make):
    lab = make(scripted(noise=0.01))
    lab.cycle()
    assert {regime(lab, c) for c in IDS} == {"learning"}
    p = lab.cli("baseline", "calibrate", "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    assert {regime(lab, c) for c in IDS} <= {"continuous", "modal"}
    run = lab.cycle()
    assert run.learning == () and set(verdicts(run).values()) <= {"within-noise", "identical"}


def test_baseline_calibrate_second_look_does_not_launder_a_move_since_the_baseline(make, tmp_path):
    # the stack moved between the baseline (pass 1) and calibrate (pass 2, another process): K probes, then
    # K more alone, all lie away from the baseline, and no model is saved
    moved = change(at=2, logprob_shift=-0.3)
    lab = make(scripted(noise_model={"preset": "gpu-bf16"}, seed=3, cycle_file=tmp_path / "n", body=moved))
    lab.cycle()
    p = lab.cli("baseline", "calibrate")
    assert p.returncode == 1, p.stdout + p.stderr
    assert p.stderr.count("the baseline lies outside the noise just measured") == len(IDS), p.stderr
    assert {regime(lab, c) for c in IDS} == {"learning"}


def test_check_learns_across_processes_and_exits_0_until_a_shift(tmp_path):
    cycles = tmp_path / "cycles"
    lab = ScriptedLab(tmp_path, scripted(noise=0.01, cycle_file=cycles, seed=1))
    try:
        for n in range(1, 11):
            # a new process each pass; a new seed each pass gives fresh noise, as a real engine's is
            lab.write(scripted(noise=0.01, cycle_file=cycles, seed=n))
            code, doc = lab.check_json()
            found = {r["verdict"] for r in doc["results"]}
            assert code == 0 and not DRIFT & found, (n, code, found)
            if n == 2:
                reasons = [r["reasons"] for r in doc["results"] if r["verdict"] == "learning"]
                assert any("5/24 probes after 1 pass" in x[0] for x in reasons), reasons
            if {regime(lab, c) for c in IDS} <= {"continuous", "modal"}:
                break
        assert n in (LEARNED_BY, LEARNED_BY + 1), n
        lab.write(scripted(noise=0.01, cycle_file=cycles, seed=0, body=change(at=n + 1, logprob_shift=-0.3)))
        code, doc = lab.check_json()  # the shift, on the first pass after learning
        assert code == 1 and {r["verdict"] for r in doc["results"]} == {"logprob-drift"}
    finally:
        lab.close()


def test_the_daemon_learns_a_noisy_backend_without_a_drift_verdict_or_alarm(tmp_path):
    (tmp_path / "plain.toml").write_text(PLAIN)
    (tmp_path / "canaryd.toml").write_text(
        'state_dir = "state"\nsuites = ["plain.toml"]\n'
        + scripted(noise=0.01)
        + f'\n[daemon]\nlisten = "127.0.0.1:{free_port()}"\ninstance = "unit"\n'
        + '[[schedules]]\nname = "fast"\nevery = "1s"\n'
    )
    path = tmp_path / "canaryd.toml"
    d = Daemon(path, load_config(path))
    d.start()
    try:
        learning_seen = set()
        deadline = time.monotonic() + 90
        while True:
            rows = d.store.observations(backend="fake", limit=1000)
            assert not DRIFT & {o.verdict for o in rows}, [o.verdict for o in rows]
            assert d.metrics.registry.get_sample_value(
                "canaryd_backend_drift_alarm", {"backend": "fake"}
            ) in (
                None,
                0,
            )
            n = d.metrics.registry.get_sample_value("canaryd_backend_learning_canaries", {"backend": "fake"})
            if n is not None:
                learning_seen.add(n)
            passes = min(sum(o.canary_id == c for o in rows) for c in IDS)
            if 0 in learning_seen and passes >= LEARNED_BY + 2:
                break
            assert time.monotonic() < deadline, "timed out waiting for the daemon's passes"
            time.sleep(0.1)
        assert 3 in learning_seen and 0 in learning_seen, learning_seen
        assert "learning" in {o.verdict for o in rows}
    finally:
        d.stop()


def test_a_model_learned_on_text_judges_answers_that_gain_logprobs_on_text(make):
    # first contact on an exact provider without logprobs: a text model; later answers carry logprobs
    lab = make(scripted(logprobs=False, body=change(at=3, logprobs=True)))
    lab.cycle()
    assert {regime(lab, c) for c in IDS} == {"exact"}
    assert set(verdicts(lab.cycle()).values()) == {"identical"}
    run = lab.cycle()
    assert set(verdicts(run).values()) == {"identical"} and {r.comparison.basis for r in run.results} == {
        "text"
    }


def test_a_learning_provider_is_held_to_its_windows_noise_floor_by_its_reference(make):
    # a noisy provider and its deterministic reference: the provider's own noise, learned so far, is the
    # floor, so its honest gap is no reference-mismatch while it learns (nor after)
    lab = make(scripted(reference="ref", noise=0.01) + scripted("ref"))
    seen = {v for _ in range(LEARNED_BY + 2) for v in verdicts(lab.cycle("fake")).values()}
    assert not DRIFT & seen and "learning" in seen, seen


def test_past_learn_max_passes_a_window_is_fitted_from_what_it_has(make):
    lab = make(scripted(noise=0.01), tail="[compare]\nlearn_k = 100\nlearn_max_passes = 3\n")
    lab.cycle()
    assert "5/100 probes after 1 pass" in lab.cycle().results[0].comparison.reasons[0]
    assert {regime(lab, c) for c in IDS} == {"learning"}
    run = lab.cycle()  # the third pass: 11 of 100 probes, fitted
    assert run.learning == () and {regime(lab, c) for c in IDS} <= {"continuous", "modal"}
    assert {NoiseModel.from_dict(lab.store.calibration("fake", c)).k for c in IDS} == {11}


def test_under_the_realistic_gpu_noise_model_learning_is_quiet_and_then_catches_a_shift(make):
    """The bf16 preset (paths by load, heavy tails, prefix-cache hits), not Gaussian noise of one sd."""
    lab = make(scripted(noise_model={"preset": "gpu-bf16"}, seed=3, body=change(at=15, logprob_shift=-0.3)))
    learned = None
    for n in range(1, 15):
        run = lab.cycle()
        assert not DRIFT & set(verdicts(run).values()), (n, verdicts(run))
        if learned is None and run.learning == ():
            learned = n
    assert learned is not None and learned <= 10, learned
    caught = [verdicts(lab.cycle()) for _ in range(2)]
    assert any(set(v.values()) == {"logprob-drift"} for v in caught), caught


def test_a_nearly_idle_bf16_engine_is_not_taken_for_exact_at_first_contact(make):
    """At load 0.05 nearly every request sent alone takes one numerical path, but first contact's crowded
    probes share a batch and take another, as on a real GPU engine: every canary learns, none passes as
    exact (to drift later, whenever the load sends a pass's own answer down another path)."""
    lab = make(scripted(noise_model={"preset": "gpu-bf16", "load": 0.05, "cache_hits": 0.0}, seed=2))
    run = lab.cycle()
    assert set(verdicts(run).values()) == {"baseline"}
    assert set(run.learning) == set(IDS) and {regime(lab, c) for c in IDS} == {"learning"}
