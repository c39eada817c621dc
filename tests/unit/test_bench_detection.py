"""The detection bench's canaryd rows: a deployment per serving configuration, the fleet composed with a
replaced member, the reference row's test, and the SYNTHETIC shim's rows, on synthetic observations with
known answers."""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import UTC, datetime

import pytest

from bench.detection_lab import SHIM_MODES, Served, Shim, check_key, composed
from bench.detection_methods import (
    OURS,
    REFERENCE_ROW,
    TRACKING_ROW,
    Reference,
    Rule,
    canaryd_reference,
    deployment,
    detector_method,
    detector_outcomes,
    judged,
    trial_refits,
)
from bench.detection_peers import DIFR, LT, LT_P, LT_PROD, MET, difr_method, lt_method, lt_windows, split
from bench.detection_shim import shim_outcomes
from bench.detection_text import TEXT_METHODS, text_only
from canaryd.backends.noise import CAP, NoiseModel, Realistic
from canaryd.canaries import Canary, Decoding
from canaryd.judge.compare import Verdict
from canaryd.judge.reference import Divergence
from canaryd.observation import Observation, TokenLogprob
from canaryd.probe.reference import Check
from canaryd.stack import configuration_of

CANARY = Canary(id="c", prompt="2+3=", decoding=Decoding(max_tokens=2, top_logprobs=2), suite="t")


def obs(fp: str, lp: float, text: str = "5", canary: str = "c", n: int = 1) -> Observation:
    """An answer of ``n`` tokens, each ``text`` at logprob ``lp``."""
    o = Observation("b", canary, "t", datetime(2026, 1, 1, tzinfo=UTC), {}, "r")
    o.text, o.system_fingerprint, o.finish_reason = text * n, fp, "stop"
    o.tokens = [TokenLogprob(text, lp, top=((text, lp), ("x", lp - 3.0)))] * n
    o.stack = {"response.system_fingerprint": fp}
    return o


def test_a_deployment_has_a_baseline_and_model_per_configuration_and_drops_a_rare_one():
    probes = [obs("f32", -0.5)] * 4 + [obs("bf16", -0.7)] * 4 + [obs("rare", -0.9)] * 2
    known = deployment({"c": probes})
    f32, bf16 = (
        configuration_of({"response.system_fingerprint": "f32"}),
        configuration_of({"response.system_fingerprint": "bf16"}),
    )
    assert list(known["c"]) == [f32, bf16]  # in the order they first answered; "rare" has 2 < 3 probes
    assert known["c"][bf16][0].tokens[0].logprob == -0.7


def test_a_probe_is_judged_by_its_own_configuration_and_a_new_one_by_the_first():
    known = deployment({"c": [obs("f32", -0.5)] * 4 + [obs("bf16", -0.7)] * 4})
    assert judged(CANARY, known, obs("bf16", -0.7)).verdict is Verdict.IDENTICAL
    assert judged(CANARY, known, obs("f32", -0.5)).verdict is Verdict.IDENTICAL
    # against one baseline per backend the bf16 answer would be drift: that is what the deployment avoids
    assert judged(CANARY, deployment({"c": [obs("f32", -0.5)] * 4}), obs("bf16", -0.7)).verdict.is_drift
    # an unknown configuration (a server replaced whole) is judged against the first: a move is drift
    assert judged(CANARY, known, obs("other", -0.9)).verdict.is_drift


def served(variant: str, pool: list[Observation]) -> Served:
    extra = {"forced": {"c": pool}, "tracking": {"c": pool}}
    return Served(variant, {"c": pool}, {"c": pool}, pool, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, extra)


def test_composed_replaces_one_member_in_every_pool():
    fleet = served("F", [obs("f32", -0.5), obs("bf16", -0.7)] * 3)
    fleet.extra["calibration"] = {"c": fleet.greedy["c"]}
    joined = served("Q1", [obs("f32", -0.6)] * 2)
    f32 = configuration_of({"response.system_fingerprint": "f32"})
    mixed = composed("FQ1", fleet, f32, joined)
    pools = (mixed.greedy["c"], mixed.samples["c"], mixed.lt, mixed.extra["forced"]["c"])
    for pool in (*pools, mixed.extra["tracking"]["c"]):
        assert sorted(o.tokens[0].logprob for o in pool) == [-0.7] * 3 + [-0.6] * 2
    assert mixed.extra["calibration"] is fleet.extra["calibration"]  # still deployed on the fleet
    assert fleet.greedy["c"][0].tokens[0].logprob == -0.5  # the fleet itself is untouched


@dataclass(frozen=True)
class Settings:
    r_probes: tuple[int, ...] = (1, 2)
    trials: int = 20
    permutation_floor: int = 999
    lt_max_n: int = 1200


def test_the_reference_row_alarms_where_an_answer_parts_or_its_logprobs_move():
    ref = Reference([CANARY], {"c": [obs("f32", -0.5)] * 4}, {}, {}, {}, [], 4)  # floor 0: exact
    same = Divergence(0.0, 0.0, 1, logprob_gap=0.0)
    ref.checks = {
        check_key(obs("f32", -0.5, "5")): Check(same, parting=0.0, noise=0.0, gap_noise=(0.0, 0.0)),
        check_key(obs("f32", -0.5, "6")): Check(Divergence(0.8, 0.8, 1), parting=0.8, noise=0.0),
        # the same text as the first, other logprobs: another answer, its own check
        check_key(obs("f32", -0.6, "5")): Check(
            Divergence(0.0, 0.0, 1, logprob_gap=0.1), parting=0.0, noise=0.0, gap_noise=(0.0,)
        ),
    }
    ref.scored = {k: tuple(obs("f32", -0.5, k[1]).tokens) for k in ref.checks}  # the reference's scores
    honest = served("N0", [obs("f32", -0.5, "5")] * 4)
    out = canaryd_reference(ref, honest, Settings(), 0.01, random.Random(0))
    assert not any(o.reject for r in out.values() for o in r)
    # half the answers part: at r = 2 a test sees one with probability 3/4
    moved = [obs("f32", -0.5, "5"), obs("f32", -0.5, "6")] * 2
    out = canaryd_reference(ref, served("Q2", moved), Settings(trials=400), 0.01, random.Random(0))
    assert 0.4 < sum(o.reject for o in out[1]) / 400 < 0.6
    assert 0.65 < sum(o.reject for o in out[2]) / 400 < 0.85
    assert all(o.score == (True, 0.0, 0.8) for o in out[2] if o.reject)
    # the same answer with moved logprobs: every test
    out = canaryd_reference(
        ref, served("Q1", [obs("f32", -0.6, "5")] * 2), Settings(), 0.01, random.Random(0)
    )
    assert all(o.reject for o in out[1])


def lt_obs(top: dict[str, float]) -> Observation:
    o = obs("f32", max(top.values()))
    o.tokens = [TokenLogprob(max(top, key=top.get), max(top.values()), top=tuple(top.items()))]
    return o


def test_lt_is_deployed_where_canaryd_is_and_scored_by_its_statistic():
    """On a fleet LT takes its reference through the balancer, as canaryd calibrates there: the fleet's own
    rows then give statistic 0 and no alarm, where the lone baseline server's reference alarms on all."""
    lone, fleet_rows = lt_obs({"a": -0.1, "b": -2.5}), lt_obs({"a": -0.3, "b": -1.5})
    ref = Reference([CANARY], {"c": [obs("f32", -0.5)] * 4}, {}, {}, {}, [lone] * 8, 4)
    fleet = served("F", [obs("f32", -0.5)] * 4)
    fleet.lt = [fleet_rows] * 8
    misdeployed = split({("LT", "F"): lt_method(ref, fleet, Settings(), 0.01, random.Random(0))})
    fleet.extra["lt calibration"] = {"lt": fleet.lt}
    deployed = split({("LT", "F"): lt_method(ref, fleet, Settings(), 0.01, random.Random(0))})
    # budgets: C·r = 1, 2 and the paper's N = 10 (one canary here); the reference window is K·C = 4 rows
    assert set(deployed[("LT", "F")]) == {1, 2, 10}
    assert not any(o.reject for x in deployed[("LT", "F")].values() for o in x)
    assert all(o.score < 1e-12 for x in deployed[("LT", "F")].values() for o in x)  # 0 up to rounding
    # |Δ| = 0.2 and 1.0 over the union {a, b}: the statistic is 0.6; −p and the production rule beside it
    wrong = misdeployed[("LT", "F")][10]
    assert all(o.reject and o.score == pytest.approx(0.6) for o in wrong)
    assert all(o.score < 0 for o in misdeployed[(LT_P, "F")][10])
    assert not any(o.reject for o in misdeployed[(LT_PROD, "F")][10])  # 0.6 ≤ 1.0: production stays quiet


def test_token_difr_scores_the_greedy_margin_of_each_answer_under_the_reference():
    """Each answer's tokens re-scored on the reference: an honest answer is the reference's own greedy
    choice (margin 0); an answer whose token the reference ranks 0.8 below its top has margin 0.8."""
    ref = Reference([CANARY], {"c": [obs("f32", -0.5, "5")] * 4}, {}, {}, {}, [], 4)
    ref.scored = {
        check_key(obs("f32", -0.5, "5")): (TokenLogprob("5", -0.2, top=(("5", -0.2), ("6", -1.0))),),
        check_key(obs("f32", -0.7, "6")): (TokenLogprob("6", -1.0, top=(("5", -0.2), ("6", -1.0))),),
    }
    honest = difr_method(ref, served("N0", [obs("f32", -0.5, "5")] * 4), Settings(), 0.01, random.Random(0))
    assert not any(o.reject or o.score for x in honest.values() for o in x)
    # the provider's logprobs play no part: an honest text with other reported logprobs is still honest
    same_text = difr_method(
        ref, served("N0", [obs("f32", -0.9, "5")] * 4), Settings(), 0.01, random.Random(0)
    )
    assert not any(o.reject for x in same_text.values() for o in x)
    half = difr_method(
        ref,
        served("G", [obs("f32", -0.5, "5"), obs("f32", -0.7, "6")] * 2),
        Settings(trials=400),
        0.01,
        random.Random(0),
    )
    assert sorted({round(o.score, 9) for o in half[1]}) == [0.0, 0.8]
    assert all(o.reject == (o.score > 0) for o in half[2])
    assert 0.65 < sum(o.reject for o in half[2]) / 400 < 0.85
    assert DIFR.startswith("Token-DiFR")


@dataclass(frozen=True)
class ShimSettings:
    r_probes: tuple[int, ...] = (1, 2)
    trials: int = 20
    null_trials: int = 40
    deployments: int = 2
    permutation_floor: int = 999
    lt_max_n: int = 1200


@pytest.mark.parametrize("level", [0.003, "gpu-bf16"])
def test_the_shim_moves_every_canaryd_mode_and_lt_alike(level):
    """canaryd's modes (shipped, teacher-forced, tracking), the reference check and LT get shimmed rows;
    an honest server gives no canaryd mode more than a few alarms under the noise (the reference check:
    within the provider's noise floor), a shift far beyond it is caught in every test: Gaussian modes, or
    the realistic model's bf16 paths."""
    ids, forced_ids = [f"c{i}" for i in range(6)], [f"f{i}" for i in range(6)]
    tracking_ids = [f"t{i}" for i in range(6)]
    canaries = [CANARY.model_copy(update={"id": i}) for i in ids]
    forced = [CANARY.model_copy(update={"id": i, "continuation": "5"}) for i in forced_ids]
    tracking = [CANARY.model_copy(update={"id": i}) for i in tracking_ids]

    def pools(lp: float, names: list[str], n: int) -> dict[str, list[Observation]]:
        return {cid: [obs("f32", lp, canary=cid, n=4) for _ in range(n)] for cid in names}

    def server(variant: str, lp: float) -> Served:
        greedy = pools(lp, ids, 8)
        return Served(
            variant,
            greedy,
            greedy,
            greedy["c0"],
            1.0,
            1.0,
            1.0,
            0.0,
            1.0,
            1.0,
            {"forced": pools(lp, forced_ids, 8), "tracking": pools(lp, tracking_ids, 8)},
        )

    ref = Reference(canaries, pools(-0.5, ids, 20), {}, {}, {}, pools(-0.5, ["c0"], 8)["c0"], 20)
    ref.forced, ref.forced_calibration = forced, pools(-0.5, forced_ids, 20)
    ref.tracking, ref.tracking_calibration = tracking, pools(-0.5, tracking_ids, 20)
    # the reference (unshimmed) scores every answer's "5" at -0.5, and answers "5" itself
    same = Check(Divergence(0.0, 0.0, 1, logprob_gap=0.0), parting=0.0, noise=0.0, gap_noise=(0.0, 0.0))
    for lp in (-0.5, -1.5):
        for cid in ids:
            key = check_key(obs("f32", lp, canary=cid, n=4))
            ref.checks[key], ref.scored[key] = same, tuple(obs("f32", -0.5, canary=cid, n=4).tokens)
    servers = {"N0": [server("N0", -0.5)], "G": [server("G", -1.5)]}
    out = split(shim_outcomes(level, ref, servers, ShimSettings(), 0.01, 0))
    # the provider's shimmed logprobs lie off the reference's, within the floor its calibration shows
    for name in (*OURS, REFERENCE_ROW):
        assert sum(len(x) for x in out[(name, "N0")].values()) == 2 * 40
        assert sum(o.reject for x in out[(name, "N0")].values() for o in x) <= 4  # α = 0.01 per test
        assert all(o.reject for o in out[(name, "G")][1])
    for name in OURS:  # a detector's alarm names the rules its first alarm cycle met; a quiet test, none
        assert all(o.raised for o in out[(name, "G")][1])
        assert all(bool(o.raised) == o.reject for x in out[(name, "N0")].values() for o in x)
    # LT at C·r per budget and its paper's N = 10 (no token counts here, so no equal-token windows), with its
    # companion rows on the same trials
    assert set(out[(LT, "G")]) == {1, 2, 10 / 6} == set(lt_windows(ref, ShimSettings()))
    for row in (LT_P, LT_PROD):
        assert {r: len(x) for r, x in out[(row, "N0")].items()} == {
            r: len(x) for r, x in out[(LT, "N0")].items()
        }


def test_the_realistic_shim_moves_logprobs_by_its_paths_and_never_a_token():
    """With a preset the shim takes the realistic model's paths: a probe on one path is moved the same way
    every time (cache hits aside), by at most CAP nats; a bf16 path moves some tokens by more than 0.1."""
    shim = Shim("gpu-bf16", random.Random(0))
    shim.model = Realistic(NoiseModel(preset="gpu-bf16", paths=SHIM_MODES, cache_hits=0.0))  # no hits
    base = obs("f32", -1.0, text="5", n=200)
    one_path = [1.0] + [0.0] * (SHIM_MODES - 1)
    a, b = shim(base, one_path), shim(base, one_path)
    assert a.tokens == b.tokens and a.text == base.text  # bit-exact on one path; the text is the server's
    assert [t.token for t in a.tokens] == [t.token for t in base.tokens]
    other = shim(base, [0.0, 1.0] + [0.0] * (SHIM_MODES - 2))
    d = [abs(x.logprob - y.logprob) for x, y in zip(a.tokens, other.tokens, strict=True)]
    assert 0 < sum(x > 0.1 for x in d) < 40 and max(d) <= 2 * CAP


def test_a_text_only_provider_races_only_what_reads_text_and_canaryd_judges_its_text():
    """Logprobs withheld: LT, the teacher-forced canaries and the reference gap sit out; canaryd, calibrated
    on text-only probes, is quiet where only logprobs moved and alarms where a text moved."""
    assert set(TEXT_METHODS) == {
        "canaryd",
        TRACKING_ROW,
        "exact text match",
        "two-sample text (T=1)",
        DIFR,
        MET,
    }
    ref = Reference([CANARY], {"c": [obs("f32", -0.5)] * 4}, {}, {}, {}, [], 4)
    servers = {"N0": [served("N0", [obs("f32", -0.5)] * 4)], "Q1": [served("Q1", [obs("f32", -0.9)] * 4)]}
    servers["Q2"] = [served("Q2", [obs("f32", -0.5, "6")] * 4)]
    tref, tservers = text_only(ref, servers)
    assert ref.calibration["c"][0].tokens and servers["Q1"][0].greedy["c"][0].tokens  # the run is untouched
    for s in (tref.calibration["c"], *(x[0].greedy["c"] for x in tservers.values())):
        assert all(not o.tokens and not o.has_logprobs for o in s)
    known = deployment(tref.calibration)
    out = {
        v: detector_method([CANARY], known, tservers[v][0].greedy, Settings(), 0.01, random.Random(0))
        for v in servers
    }
    for v in ("N0", "Q1"):  # only logprobs moved on Q1: the text basis cannot see it
        assert not any(o.reject for x in out[v].values() for o in x)
        assert {o.score for o in out[v][2]} == {(False, 0.5, 0)}
    # one canary alone cannot alarm on one cycle at alpha 0.01 (its p-value ≥ 1/(K+1)); on two it does
    assert all(o.reject and o.score[2] == 2 for o in out["Q2"][2])


def test_the_null_bench_counts_each_deployments_alarms_rules_and_outs():
    """`bench/shim_null.py`: an exact server's honest answers under the shim, per detector row; an answer
    that never moves (no shim) is never out and never alarms."""
    from bench.shim_null import Deployed, Settings, honest

    ref, servers = honest(6, 20, 16, seed=0)
    out = split(shim_outcomes("gpu-bf16", ref, servers, Settings((4,), 10), 0.01, seed=0))
    for row in OURS:
        x = Deployed.of(out[(row, "N0")][4], 4 * 6)
        assert x.tests == 10 and x.cells == 240 and 0 <= x.outs <= x.cells
        assert sum(x.rules.values()) >= x.alarms  # each alarm names at least one rule
    still = split(shim_outcomes(0.0, ref, servers, Settings((4,), 10), 0.01, seed=0))
    assert all(Deployed.of(still[(row, "N0")][4], 24) == Deployed(0, 10, {}, 0, 240, 0) for row in OURS)


def test_a_calibration_spread_over_more_days_sees_more_routes_and_leaves_fewer_honest_outs():
    """`shim_outcomes(cal_days=…)`: the same K probes over one simulated day see one load mix, and a later
    day's routes fall outside them; over K days they see the day-to-day mixes, at no cost in requests."""
    from bench.shim_null import Deployed, Settings, honest

    ref, servers = honest(6, 20, 16, seed=0)

    def outs(days: int) -> int:
        total = 0
        for seed in range(4):
            settings = Settings((4,), 10)  # the calibration alone: refits would widen it
            out = split(shim_outcomes("gpu-bf16", ref, servers, settings, 0.01, seed, days, living=False))
            total += sum(Deployed.of(out[(row, "N0")][4], 24).outs for row in OURS)
        return total

    one, twenty = outs(1), outs(20)
    assert one > 4 * twenty > 0, (one, twenty)


def test_the_detector_rows_refit_an_honest_growth_of_noise_as_the_product_does_and_never_a_shift():
    """`detection_living`: after a cycle's decision, a canary out of its noise whose answers kept their
    location gets the product's refit probes and joins them to its model, so a noise that grew (up and down
    around the centre) stops being out; logprobs moved one way are never refit, and judge as without."""
    rng = random.Random(0)
    cids = [f"c{i}" for i in range(3)]
    canaries = [CANARY.model_copy(update={"id": c}) for c in cids]

    def answer(cid: str, sd: float, shift: float = 0.0) -> Observation:
        o = obs("f32", -0.5, canary=cid)
        lps = [-0.5 + shift + rng.gauss(0, sd) for _ in range(8)]
        o.tokens = [TokenLogprob("5", x, top=(("5", x), ("x", x - 3.0 + rng.gauss(0, sd)))) for x in lps]
        return o

    known = deployment({c: [answer(c, 0.01) for _ in range(20)] for c in cids})
    rule = Rule(None, 1e4)

    def tests(sd: float, shift: float, living: bool) -> tuple[int, int, int]:
        """Canary-cycles out in the later half of 10 tests of 12 cycles, alarms, refit probes."""
        later = alarms = spent = 0
        for _ in range(10):
            pools = {c: [answer(c, sd, shift) for _ in range(40)] for c in cids}
            observed = [{c: rng.choice(pools[c]) for c in cids} for _ in range(12)]
            cycles = [
                {c: judged(cn, known, o[c]) for c, cn in zip(cids, canaries, strict=True)} for o in observed
            ]
            refits = trial_refits(canaries, known, observed, pools, rng)() if living else None
            half, whole = detector_outcomes(cycles, rule, [6, 12], refits).values()
            later += whole.score[2] - half.score[2]
            alarms, spent = alarms + whole.reject, spent + whole.refit_probes
        return later, alarms, spent

    grown, refit = tests(0.015, 0.0, False), tests(0.015, 0.0, True)
    assert grown[2] == 0 and refit[2] > 0  # the refits' probes are counted, and only where refits ran
    assert refit[0] < grown[0] / 3, (grown, refit)  # once the model widened, its canaries stay in
    shifted, tried = tests(0.01, -0.3, False), tests(0.01, -0.3, True)
    assert tried[2] == 0 and tried[:2] == shifted[:2] and shifted[1] == 10  # no refit: every test alarms
