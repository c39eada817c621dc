"""The detection bench's product path (`bench.detection_product`) through the real `scripted` kind: a
deployment is `canaryd check` passes until nothing learns, a test one more pass from a copy of that state on
the tested backend under the same name, and an alarm is exit code 1 with the verdicts that raised it."""

from __future__ import annotations

from bench.detection_product import alarms, deploy, trial_passes
from tests.harness.scripted_lab import change, scripted
from tests.harness.suites import PLAIN


def suite(tmp_path):
    path = tmp_path / "plain.toml"
    path.write_text(PLAIN)
    return [path]


def test_an_honest_backend_is_quiet_and_a_shift_alarms(tmp_path):
    dep = deploy(tmp_path / "dep", scripted(name="bench", seed=1), suite(tmp_path))
    assert dep.learned and len(dep.passes) == 2  # exact: first contact, then judged
    quiet = trial_passes(dep, scripted(name="bench", seed=1), 3, tmp_path / "work")
    assert alarms(quiet) == (0, {})
    shifted = scripted(name="bench", seed=1, body=change(at=1, logprob_shift=-0.3))
    hits, why = alarms(trial_passes(dep, shifted, 2, tmp_path / "work"))
    assert hits == 2 and why["logprob-drift"] == 2


def test_a_false_alarm_only_the_product_raises_shows(tmp_path):
    """Same answers, another stack snapshot: the judge on collected probes would stay quiet."""
    dep = deploy(tmp_path / "dep", scripted(name="bench", seed=1), suite(tmp_path))
    moved = scripted(name="bench", seed=1, body=change(at=1, stack={"vllm.version": "0.0.0-other"}))
    hits, why = alarms(trial_passes(dep, moved, 2, tmp_path / "work"))
    assert hits == 2 and why["stack-change"] == 2


def test_a_noisy_backend_is_learned_before_it_is_tested(tmp_path):
    backend = scripted(name="bench", seed=2, noise_model={"preset": "gpu-bf16"}, cycle_file=tmp_path / "cyc")
    dep = deploy(tmp_path / "dep", backend, suite(tmp_path))
    assert dep.learned and len(dep.passes) > 2
    hits, _ = alarms(trial_passes(dep, backend, 4, tmp_path / "work"))
    assert hits == 0
