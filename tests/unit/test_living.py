"""Calibration that lives (docs/detection.md, "Calibration that lives"), through the real `scripted` kind:
noise that grows honestly (a doubled sd, the load of a GPU engine's batches) pages for at most a pass or
three and is then absorbed by a refit; a change (a shift, a slow ramp) is caught, after a refit too, and
never absorbed; honest constant noise stays quiet. The rule's pure half is tested on points.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from rich.console import Console

from canaryd.judge.living import W_FLOOR, location, reach, refit
from canaryd.judge.stats import NoiseModel, Point, distance, fit_points
from canaryd.report.record import build_record, to_markdown
from canaryd.report.tables import history_table
from tests.harness.scripted_lab import ScriptedLab, change, scripted, verdicts

DRIFT = {"regression", "reference-mismatch", "answer-drift", "logprob-drift", "stack-change"}
LEARNED = 10  # learning is done by the end of this pass at the defaults (tests/unit/test_learning.py)
AT = 15  # the pass the change comes in


def passes(lab: ScriptedLab, n: int) -> list[dict[str, str]]:
    return [verdicts(lab.cycle()) for _ in range(n)]


def paged(seen: list[dict[str, str]]) -> list[int]:
    """The passes (1-based, counted from the change) with a drift verdict."""
    return [i for i, v in enumerate(seen, 1) if DRIFT & set(v.values())]


def model(lab: ScriptedLab, cid: str) -> NoiseModel:
    return NoiseModel.from_dict(lab.store.calibration("fake", cid))


def test_a_doubled_noise_sd_pages_for_at_most_three_passes_and_a_shift_is_still_caught_after_it(make):
    body = change(at=AT, noise=0.02) + change(at=AT + 15, logprob_shift=-0.05)
    lab = make(scripted(noise=0.01, seed=11, body=body))
    assert not paged(passes(lab, AT - 1))
    first = {c: model(lab, c) for c in ("add", "capital", "colors")}
    grown = passes(lab, 15)
    assert len(paged(grown)) <= 3, grown
    after = {c: model(lab, c) for c in first}
    assert any(m.refit for m in after.values())
    for c, m in after.items():  # a refit only adds: the first probes, their spread and centre stay
        assert m.refs[: first[c].k] == first[c].refs and m.spread == first[c].spread
    # the refit is on record: the calibration row, and the pass's reasons and evidence
    rows = lab.store.observations(backend="fake", limit=100)
    noted = [o for o in rows if "refit" in (o.comparison.get("evidence") or {}).get("detail", {})]
    assert noted and all(any("noise model refit #" in r for r in o.comparison["reasons"]) for o in noted)
    shown = Console(width=400, record=True)
    shown.print(history_table(rows))
    assert "+ refit" in shown.export_text()
    rec = build_record(lab.store, sorted({o.run_id for o in rows}))
    assert {f["canary"] for f in rec["refits"]} == {o.canary_id for o in noted}
    assert "Noise models refit" in to_markdown(rec)
    assert model(lab, noted[0].canary_id).summary()["refit"]["count"] >= 1  # as the calibration row shows
    # a -0.05 nat shift after the refit: caught within 5 passes, and it stays caught
    shifted = passes(lab, 8)
    assert paged(shifted) and paged(shifted)[0] <= 5 and paged(shifted) == list(range(paged(shifted)[0], 9))
    assert {m.refit.count if m.refit else 0 for m in map(lambda c: model(lab, c), first)} == {
        m.refit.count if m.refit else 0 for m in after.values()
    }


def test_a_gpu_engine_whose_load_rises_from_0_2_to_0_9_pages_for_at_most_three_passes(make):
    bf16 = {"preset": "gpu-bf16", "load": 0.2}
    lab = make(scripted(noise_model=bf16, seed=5, body=change(at=AT, noise_model={**bf16, "load": 0.9})))
    assert not paged(passes(lab, AT - 1))
    seen = passes(lab, 20)
    assert len(paged(seen)) <= 3, seen
    assert not paged(seen[5:])


def test_without_refits_a_doubled_noise_sd_pages_every_pass(make):
    lab = make(
        scripted(noise=0.01, seed=11, body=change(at=AT, noise=0.02)), tail="[compare]\nrefit = false\n"
    )
    passes(lab, AT - 1)
    assert len(paged(passes(lab, 10))) >= 8


@pytest.mark.parametrize(
    "noise", [{"noise": 0.01}, {"noise_model": {"preset": "gpu-bf16"}}], ids=["sd", "bf16"]
)
def test_a_slow_ramp_is_caught_before_minus_0_1_nats_and_never_absorbed(make, noise):
    # -0.3 nats over 100 passes: -0.003 a pass, past -0.1 after 33
    lab = make(scripted(seed=2, body=change(at=AT, logprob_ramp=-0.003), **noise))
    assert not paged(passes(lab, AT - 1))
    seen = []
    for _ in range(40):
        seen.append(verdicts(lab.cycle()))
        if len(paged(seen)) == 1:  # caught: from here on no refit may follow it
            refits = {c: model(lab, c).refit for c in ("add", "capital", "colors")}
    caught = paged(seen)
    assert caught and caught[0] <= 33, seen
    assert caught == list(range(caught[0], 41)), caught  # never absorbed: it stays drift
    assert {c: model(lab, c).refit for c in refits} == refits


def test_honest_constant_noise_stays_quiet_with_refits_on(make):
    lab = make(scripted(noise=0.01, seed=4))
    seen = passes(lab, 60)
    assert not paged(seen)
    assert {v for s in seen[LEARNED:] for v in s.values()} <= {"within-noise", "identical"}


def _probe(rng: random.Random, sd: float, shift: float = 0.0) -> Point:
    return Point(
        ("4", "2"),
        {(i, t): -0.5 - j + rng.gauss(shift, sd) for i in range(2) for j, t in enumerate("abcdef")},
    )


def test_refit_admits_a_wider_spread_and_refuses_a_moved_location_or_what_passes_the_cap():
    rng = random.Random(0)
    first = fit_points("r", tuple(_probe(rng, 0.01) for _ in range(24)), {})
    loc = location(first)
    wider = refit(first, [_probe(rng, 0.02) for _ in range(4)], loc, cap=3.0, at="now")
    assert isinstance(wider, NoiseModel) and wider.k == 28 and wider.refit.first == 24
    assert wider.threshold > first.threshold and location(wider).bound == loc.bound
    moved = refit(first, [_probe(rng, 0.02, shift=-0.05) for _ in range(4)], loc, cap=3.0, at="now")
    assert isinstance(moved, str) and "moved one way" in moved
    far = refit(first, [_probe(rng, 0.2) for _ in range(4)], loc, cap=1.5, at="now")
    assert isinstance(far, str) and "widening cap" in far
    # a model stored with its refit reads back the same
    assert NoiseModel.from_dict(wider.as_dict()).refit == wider.refit


def test_a_model_without_logprob_coordinates_has_a_location_that_tells_nothing():
    """A text-only answer (a provider without logprobs) has no coordinate: its location is the floor and
    no probe's statistic is defined, so a pass's refit check skips it (it used to raise on every pass)."""
    texts = [Point(("Paris",), {}), Point(("Lyon",), {})] * 6
    loc = location(fit_points("r", tuple(texts), {}))
    assert loc.centre == {} and loc.bound == W_FLOOR
    assert loc.t(fit_points("r", tuple(texts), {}), Point(("Paris",), {})) is None


def test_a_modal_model_whose_every_path_came_twice_admits_a_grown_path_within_the_cap():
    """A GPU engine's first K probes: a few bit-exact paths, each seen twice, so no probe's leave-one-out
    distance exceeds 0. The cap is measured against the gap between its paths (`reach`), not that 0:
    new paths of a grown noise are admitted, one far beyond the cap is still refused."""
    rng = random.Random(1)
    paths = [_probe(rng, 0.01) for _ in range(6)]
    first = fit_points("r", tuple(p for p in paths for _ in range(2)), {})
    assert max(first.loo) == 0.0  # each path has its bit-exact twin
    assert reach(first, first.refs) == max(
        min(distance(p, o, first.spread, first.default_spread) for o in paths if o is not p) for p in paths
    )
    loc = location(first)
    grown = refit(first, [_probe(rng, 0.02) for _ in range(4)], loc, cap=3.0, at="now")
    assert isinstance(grown, NoiseModel) and grown.k > first.k, grown
    assert grown.refit.loo_max == 0.0  # what the record shows as the first threshold stays the first model's
    far = refit(first, [_probe(rng, 0.3) for _ in range(4)], loc, cap=1.5, at="now")
    assert isinstance(far, str) and "widening cap" in far


def test_on_the_13_canary_default_suite_every_gpu_offset_doubled_pages_for_at_most_three_passes(make):
    """A grown noise on many canaries: each goes out on the paths its model has not seen at the new scale,
    one after another, so a refit must admit new paths (the cap measured against the gap between the
    first paths) from probes that take the paths the pass's answers take (sent alone)."""
    bf16 = {"preset": "gpu-bf16"}
    suite = (Path(__file__).parents[2] / "canaries" / "default.toml").read_text()
    wider = change(at=AT, noise_model={**bf16, "scale": 2.0})
    lab = make(scripted(noise_model=bf16, seed=4, body=wider), suites={"default.toml": suite})
    assert not paged(passes(lab, AT - 1))
    seen = passes(lab, 20)
    assert len(paged(seen)) <= 3, seen
