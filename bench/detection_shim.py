"""The detection bench's SYNTHETIC rows: canaryd's modes and LT rerun with the noise shim on every logprob
the tested and calibrated servers give them (`detection_lab.Shim`)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from functools import cache, partial

import numpy as np

from bench.detection_lab import SHIM_CAL_DAYS, Served, Shim
from bench.detection_methods import (
    DEFAULT_RULE,
    REFERENCE_ROW,
    TRACKING_ROW,
    Floors,
    Known,
    Outcome,
    Reference,
    alpha_rule,
    deployment,
    detector_outcomes,
    draw,
    floors_of,
    judged,
    permutations_for,
    reference_outcomes,
    trial_refits,
)
from bench.detection_peers import LT, lt_outcome, lt_reference, lt_windows
from bench.peers import LT_HISTORY, lt_statistic
from canaryd.backends.noise import Preset
from canaryd.canaries import Canary
from canaryd.observation import Observation


def shimmed_deployment(
    shim: Shim, mixes: Sequence[Sequence[float]], probes: dict[str, list[Observation]]
) -> Known:
    """A deployment calibrated on these probes as the shim moves them, spread over the simulated days."""
    return deployment(
        {cid: [shim(o, mixes[i % len(mixes)]) for i, o in enumerate(obs)] for cid, obs in probes.items()}
    )


# canaryd's modes under the shim: (row, canaries, the served pools, the calibration a deployment keeps)
def _shim_modes(ref: Reference, served: Served) -> list[tuple[str, list[Canary], dict, dict]]:
    return [
        ("canaryd", ref.canaries, served.greedy, served.extra.get("calibration", ref.calibration)),
        (
            "canaryd teacher-forced",
            ref.forced,
            served.extra["forced"],
            served.extra.get("forced calibration", ref.forced_calibration),
        ),
        (
            TRACKING_ROW,
            ref.tracking,
            served.extra["tracking"],
            served.extra.get("tracking calibration", ref.tracking_calibration),
        ),
    ]


def _shim_trial(
    ref: Reference,
    mode: tuple[str, list[Canary], dict, dict],
    deployed: tuple[Known, Floors],
    moving: Callable[[Observation], Observation],
    settings,
    alpha: float,
    rng: random.Random,
    living: bool = True,
) -> dict[str, dict[int, Outcome]]:
    """One trial of one canaryd mode under the shim, row → budget → outcome: the detector (knobs from alpha,
    and the shipped defaults; ``living``: with the product's refits, `detection_living`) and, on the shipped
    canaries' answers, the reference check."""
    name, canaries, pools, _ = mode
    known, floors = deployed
    longest = max(settings.r_probes)
    k = min(len(model.loo) for per in known.values() for _, model in per.values())
    rules = {name: alpha_rule(alpha, longest, k, len(canaries))}
    if name == "canaryd":
        rules[f"canaryd (defaults: arl {DEFAULT_RULE.arl:g})"] = DEFAULT_RULE
    drawn = [{cn.id: rng.choice(pools[cn.id]) for cn in canaries} for _ in range(longest)]
    moved = [{cid: moving(o) for cid, o in cycle.items()} for cycle in drawn]
    cycles = [{cn.id: judged(cn, known, m[cn.id]) for cn in canaries} for m in moved]
    refits = trial_refits(canaries, known, moved, pools, rng, moving)
    out = {
        row: detector_outcomes(cycles, rule, settings.r_probes, refits() if living else None)
        for row, rule in rules.items()
    }
    if name == "canaryd":  # the same answers as served, and with the provider's logprobs as reported
        pairs = [{cid: (a[cid], m[cid]) for cid in a} for a, m in zip(drawn, moved, strict=True)]
        after = reference_outcomes(ref, pairs, floors, alpha)
        out[REFERENCE_ROW] = {r: after[r] for r in settings.r_probes}
    return out


def shim_outcomes(
    sigma: float | Preset,
    ref: Reference,
    servers: dict[str, list[Served]],
    settings,
    alpha: float,
    seed: int,
    cal_days: int = SHIM_CAL_DAYS,
    living: bool = True,
) -> dict[tuple[str, str], dict[float, list[Outcome]]]:
    """canaryd (shipped, teacher-forced, reference gap) and LT when every logprob the tested server gives
    carries SYNTHETIC mode noise of scale sigma, or the realistic model's preset sigma (`Shim`; the text
    methods and Token-DiFR are untouched: the shim never changes a token, and the reference is unshimmed).

    Each deployment draws fresh mode offsets and a fresh calibration: canaryd's K probes per canary over
    ``cal_days`` days, and LT's reference window, K·C probes over the same days, from the same place
    (the fleet's balancer where canaryd is deployed there); each trial is a new day for the tested server,
    the same day for every method. The reference check scores the shimmed answers on an unshimmed
    reference (a local deterministic engine, as vLLM CPU is), within the provider's noise floor from the
    shimmed calibration."""
    out: dict[tuple[str, str], dict[float, list[Outcome]]] = {}
    windows = lt_windows(ref, settings)
    b = permutations_for(alpha, settings.permutation_floor)

    def add(name: str, variant: str, r: float, o: Outcome) -> None:
        out.setdefault((name, variant), {}).setdefault(r, []).append(o)

    for d in range(settings.deployments):
        rng = random.Random(f"{seed}-{sigma}-{d}")
        npr = np.random.default_rng(rng.getrandbits(63))
        shim = Shim(sigma, rng)
        mixes = [shim.day() for _ in range(cal_days)]
        # by id of the calibration probes (the baseline server's, the fleet's): the deployment, its floors
        deployed: dict[int, tuple[Known, Floors]] = {}
        # by id of LT's reference pool: its reference window, and its honest history per window size
        lt_deployed: dict[int, tuple[list[dict[str, float]], dict[int, Callable]]] = {}
        for variant, served in servers.items():
            trials = settings.null_trials if variant == "N0" else settings.trials
            for t in range(math.ceil(trials / settings.deployments)):
                s = served[t % len(served)]
                mix = shim.day()
                for mode in _shim_modes(ref, s):
                    probes = mode[3]
                    if id(probes) not in deployed:
                        known = shimmed_deployment(shim, mixes, probes)
                        deployed[id(probes)] = known, floors_of(known)
                    moving = partial(shim, mix=mix)
                    trial = _shim_trial(ref, mode, deployed[id(probes)], moving, settings, alpha, rng, living)
                    for row, by_r in trial.items():
                        for r, o in by_r.items():
                            add(row, variant, r, o)
                pool = lt_reference(ref, s)
                if id(pool) not in lt_deployed:
                    cal = draw(pool, ref.k * len(ref.canaries), rng)
                    w1 = [shim.first_top(o, mixes[i % len(mixes)]) for i, o in enumerate(cal)]
                    lt_deployed[id(pool)] = (
                        w1,
                        {n: cache(partial(_lt_history, shim, w1, pool, n, rng)) for n in windows.values()},
                    )
                w1, history = lt_deployed[id(pool)]
                for r, n in windows.items():
                    w2 = [shim.first_top(o, mix) for o in draw(s.lt, n, rng)]
                    add(LT, variant, r, lt_outcome(w1, w2, history[n], alpha, b, npr))
    return out


def _lt_history(shim: Shim, w1: list, pool: list[Observation], n: int, rng: random.Random) -> list[float]:
    """LT_HISTORY honest statistics before a test: the reference against a window of its own pool, each on
    a day of its own."""
    out = []
    for _ in range(LT_HISTORY):
        day = shim.day()
        out.append(lt_statistic(w1, [shim.first_top(o, day) for o in draw(pool, n, rng)]))
    return out
