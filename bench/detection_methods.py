"""The detection bench's methods: each turns what a server gave into test outcomes at every budget.

A method is a function ``(reference, served, settings, alpha, rng) -> {r: [Outcome, ...]}``: for each
budget r (r requests per canary or prompt, so C·r requests per test on the tested server), one Outcome per
Monte-Carlo trial: whether the test rejected at the per-test false-alarm rate alpha, and a score (higher:
more evidence of a change; floats or tuples, compared in order) for the ROC AUC. Every trial draws its
requests from the pools the servers gave, so all methods see the same servers at the same budget.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from bench.detection_lab import Served, check_key
from bench.detection_living import KNOBS, Known, Refits
from canaryd.canaries import Canary
from canaryd.config import CompareConfig
from canaryd.judge import reference
from canaryd.judge.compare import Comparison, compare, decide
from canaryd.judge.sampled import answer, answer_test
from canaryd.judge.stats import DetectorState, NoiseModel, fit, noise_floor
from canaryd.observation import Observation, TokenLogprob
from canaryd.probe.calibrate import MIN_PROBES
from canaryd.probe.reference import Check
from canaryd.stack import configuration_of


@dataclass(frozen=True)
class Rule:
    """``decide``'s knobs for one test."""

    min_out: int | None  # None: `decide` derives it from arl (`stats.min_out_for`), as the daemon does
    arl: float


def alpha_rule(alpha: float, r: int, k: int, c: int) -> Rule:
    """Knobs under which every test of up to r cycles false-alarms with probability ≤ alpha: the e-CUSUM
    threshold 2r/alpha (Ville plus a union bound over the r starts: ≤ alpha/2) and the smallest min_out m
    with r·C(c, m)/(k+1)^m ≤ alpha/2 (an honest canary is out with probability ≤ 1/(k+1))."""
    q = 1 / (k + 1)
    m = next((m for m in range(1, c + 1) if r * math.comb(c, m) * q**m <= alpha / 2), c + 1)
    return Rule(m, 2 * r / alpha)


DEFAULT_RULE = Rule(CompareConfig().min_out, CompareConfig().arl)


@dataclass(frozen=True)
class Outcome:
    reject: bool
    score: object
    # companion rows decided on the same trial (row name → its outcome): `detection_peers.split` makes
    # them rows of their own, so their intervals pair trial by trial with this row's
    also: tuple[tuple[str, Outcome], ...] = ()
    # a detector's alarm: the rules its first alarm cycle met (`Decision.raised`)
    raised: tuple[str, ...] = ()
    refit_probes: int = 0  # a detector's requests beyond its C·r: the refits' probes (`detection_living`)


# canaryd's reference check, named for what it measures: the gap between the provider's reported logprobs
# and the reference's scoring of the same answer (and an answer's parting from the reference's own)
REFERENCE_ROW = "canaryd reference: gap to reported logprobs"
TRACKING_ROW = "canaryd tracking"  # the shipped tracking suite, LT's probe shape as canaries
SHIPPED = "canaryd"  # the shipped default suite's canaries
OURS = (SHIPPED, "canaryd teacher-forced", TRACKING_ROW)  # canaryd's modes that compete on budget


@dataclass
class Reference:
    """The baseline server's side: canaryd's calibration and baseline, the peers' reference samples, the
    forced canaries' calibration, and the reference checks of every answer any server gave (the baseline
    server is the reference: the weights and precision every variant claims)."""

    canaries: list[Canary]
    calibration: dict[str, list[Observation]]
    models: dict[str, NoiseModel]
    baseline: dict[str, Observation]
    samples: dict[str, list[Observation]]
    lt: list[Observation]
    k: int
    forced: list[Canary] = field(default_factory=list)
    forced_calibration: dict[str, list[Observation]] = field(default_factory=dict)
    tracking: list[Canary] = field(default_factory=list)  # the shipped tracking suite
    tracking_calibration: dict[str, list[Observation]] = field(default_factory=dict)
    checks: dict[tuple, Check] = field(default_factory=dict)  # `detection_lab.check_key` → its check
    # `detection_lab.check_key` → the reference's scoring of that answer's text
    scored: dict[tuple, tuple[TokenLogprob, ...]] = field(default_factory=dict)
    met: dict[str, list[tuple[str, ...]]] = field(default_factory=dict)  # `detection_met.completions`


Method = Callable[[Reference, Served, object, float, random.Random], dict[int, list[Outcome]]]


def permutations_for(level: float, floor: int = 999) -> int:
    """Enough permutations that a p-value can fall to half the level, and at least ``floor``."""
    return max(floor, math.ceil(2 / level) - 1)


def draw(pool: Sequence, r: int, rng: random.Random) -> list:
    return rng.sample(list(pool), r) if r <= len(pool) else rng.choices(pool, k=r)


# -- canaryd, as shipped ----------------------------------------------------------------------------------
def judge(canary: Canary, base: Observation, obs: Observation, model: NoiseModel) -> Comparison:
    """One probe of a calibrated canary against its baseline: what `probe.judge` computes."""
    check = canary.expect.check if canary.expect else None
    return compare(
        base,
        obs,
        correct=check(obs.text or "") if check else None,
        baseline_correct=check(base.text or "") if check else None,
        noise=model,
    )


def detector_outcomes(
    cycles: Sequence[dict[str, Comparison]], rule: Rule, rs: Sequence[int], refits: Refits | None = None
) -> dict[int, Outcome]:
    """Run `decide` from a fresh detector over the cycles; the test of r cycles is their first r. Score:
    (alarm on, largest e-CUSUM statistic, canaries out), all up to cycle r; an alarm names the rules that
    raised it, so that false alarms can be told apart by the path that let them through. With ``refits``,
    each cycle's decision is followed by the product's refits (`detection_living`), and a refit model
    judges the later cycles."""
    state, peak, outs, after = DetectorState(), 0.0, 0, {}
    alarmed = False  # the backend's alarm stays on once raised
    raised: tuple[str, ...] = ()
    for j, cycle in enumerate(cycles, 1):
        if refits is not None:
            cycle = {cid: refits.comparison(j - 1, cid, c) for cid, c in cycle.items()}
        ids = list(cycle)
        d = decide(ids, [cycle[i] for i in ids], state, arl=rule.arl, min_out=rule.min_out)
        state, peak, outs = d.state, max(peak, d.state.statistic), outs + len(d.out)
        raised = raised or d.raised
        alarmed = alarmed or state.alarm
        spent = refits.probes if refits is not None else 0
        after[j] = Outcome(alarmed, (alarmed, peak, outs), raised=raised, refit_probes=spent)
        if refits is not None:
            state = refits.after(j - 1, cycle, d)
    return {r: after[r] for r in rs}


def trial_refits(
    canaries: Sequence[Canary],
    known: Known,
    observed: Sequence[dict[str, Observation]],
    pools: dict[str, list[Observation]],
    rng: random.Random,
    moving: Callable[[Observation], Observation] = lambda o: o,
) -> Callable[[], Refits]:
    """A fresh `Refits` for each row that judges this trial; the refit probes of a cycle are drawn once, on
    first use, so that every row sees the same ones (``moving``: the shim's move of what the server gave)."""
    drawn: dict[tuple[int, str], list[Observation]] = {}

    def more(j: int, cid: str) -> list[Observation]:
        if (j, cid) not in drawn:
            drawn[j, cid] = [moving(rng.choice(pools[cid])) for _ in range(KNOBS.refit_probes)]
        return drawn[j, cid]

    return lambda: Refits(canaries, known, observed, more, judge)


def deployment(calibration: dict[str, list[Observation]]) -> Known:
    """What ``baseline calibrate`` keeps of these probes: per canary and serving configuration (in the order
    they first answered), the first probe as the baseline and a noise model; a configuration with fewer
    than MIN_PROBES probes gets none, as in canaryd."""
    known: Known = {}
    for cid, obs in calibration.items():
        groups: dict[str, list[Observation]] = {}
        for o in obs:
            groups.setdefault(configuration_of(o.stack), []).append(o)
        known[cid] = {cfg: (g[0], fit(g)) for cfg, g in groups.items() if len(g) >= MIN_PROBES}
    return known


def judged(canary: Canary, known: Known, obs: Observation) -> Comparison:
    """A probe against its own configuration's baseline and model; a configuration the deployment never
    saw against the first one. That is canaryd's rule for a pass no known configuration served (a server
    replaced whole), which every single-server variant is: the bench's passes never mix known and new."""
    per = known[canary.id]
    base, model = per.get(configuration_of(obs.stack), next(iter(per.values())))
    return judge(canary, base, obs, model)


def detector_method(
    canaries: Sequence[Canary],
    known: Known,
    pools: dict[str, list[Observation]],
    settings,
    alpha: float,
    rng: random.Random,
) -> dict:
    """C canaries, r probes each, drawn from the pools; calibrated `compare` + `decide`, knobs from alpha,
    and the product's refits (`detection_living`)."""
    k = min(len(model.loo) for per in known.values() for _, model in per.values())
    rule = alpha_rule(alpha, max(settings.r_probes), k, len(canaries))
    comparisons = {c.id: [judged(c, known, o) for o in pools[c.id]] for c in canaries}
    out: dict[int, list[Outcome]] = {r: [] for r in settings.r_probes}
    longest = max(settings.r_probes)
    for _ in range(settings.trials):
        picks = {cid: draw(range(len(js)), longest, rng) for cid, js in comparisons.items()}
        cycles = [{cid: comparisons[cid][i[j]] for cid, i in picks.items()} for j in range(longest)]
        observed = [{cid: pools[cid][i[j]] for cid, i in picks.items()} for j in range(longest)]
        refits = trial_refits(canaries, known, observed, pools, rng)()
        for r, o in detector_outcomes(cycles, rule, settings.r_probes, refits).items():
            out[r].append(o)
    return out


def canaryd_shipped(ref: Reference, served: Served, settings, alpha: float, rng: random.Random) -> dict:
    """canaryd as shipped, deployed where the variant is served: on the baseline server, or (the fleet) on
    the balancer, calibrated through it, a baseline and model per serving configuration."""
    known = deployment(served.extra.get("calibration", ref.calibration))
    return detector_method(ref.canaries, known, served.greedy, settings, alpha, rng)


def canaryd_forced(ref: Reference, served: Served, settings, alpha: float, rng: random.Random) -> dict:
    """Teacher-forced canaries: short raw prompts whose fixed continuation (the baseline server's own greedy
    answer) is scored by prompt_logprobs; calibrated and judged like any canary."""
    known = deployment(served.extra.get("forced calibration", ref.forced_calibration))
    return detector_method(ref.forced, known, served.extra["forced"], settings, alpha, rng)


def canaryd_tracking(ref: Reference, served: Served, settings, alpha: float, rng: random.Random) -> dict:
    """The shipped tracking suite (`canaries/tracking.toml`: LT's probe shape, one-token raw prompts, one
    token out, top-20 logprobs, no expected answer); calibrated and judged like any canary."""
    known = deployment(served.extra.get("tracking calibration", ref.tracking_calibration))
    return detector_method(ref.tracking, known, served.extra["tracking"], settings, alpha, rng)


Floors = dict[str, dict[str, float]]  # canary → configuration → the provider's noise floor (nats)


def floors_of(known: Known) -> Floors:
    """What the provider's calibration sets as the reference check's bar (`stats.noise_floor`)."""
    return {cid: {cfg: noise_floor(model) for cfg, (_, model) in per.items()} for cid, per in known.items()}


def reference_outcomes(
    ref: Reference, cycles: Sequence[dict[str, tuple[Observation, Observation]]], floors: Floors, alpha: float
) -> dict[int, Outcome]:
    """The reference check over the cycles (canary → the answer as served, and as the provider reported
    its logprobs): each answer's parting and its logprob gap to the reference's scoring tested against the
    reference's own (`canaryd.judge.reference.canary_p_value`), within the provider's noise floor under the
    answer's configuration as canaryd applies it, Bonferroni over the canaries at alpha / R per cycle (a
    union bound over a test's R cycles). The test of r cycles is their first r. Score: (alarm on, largest
    gap, largest parting)."""
    tolerance = CompareConfig().logprob_tolerance
    alarmed, gap, part, after = False, 0.0, 0.0, {}
    for j, cycle in enumerate(cycles, 1):
        keys = {cid: check_key(served) for cid, (served, _) in cycle.items()}
        checks = {cid: ref.checks[key] for cid, key in keys.items()}
        null = [x.noise for x in checks.values() if x.noise is not None]
        gap_null = [g for x in checks.values() for g in x.gap_noise]
        p, gaps = {}, []
        for cid, (served, reported) in cycle.items():
            x = checks[cid]
            g = reference.divergence(ref.scored[keys[cid]], reported.tokens).logprob_gap
            per = floors[cid]
            floor = per.get(configuration_of(served.stack), next(iter(per.values())))
            p[cid] = reference.canary_p_value(x.parting, null, g, gap_null, max(tolerance, floor))
            gaps.append(g or 0.0)
        alarmed = alarmed or reference.decide(p, alpha / len(cycles)).mismatch
        gap = max(gap, *gaps)
        part = max(part, *(x.parting or 0.0 for x in checks.values()))
        after[j] = Outcome(alarmed, (alarmed, gap, part))
    return after


def canaryd_reference(ref: Reference, served: Served, settings, alpha: float, rng: random.Random) -> dict:
    """The reference check: each greedy answer re-scored on the reference (the baseline server: the weights
    the variant claims), as `reference_outcomes` judges it, the provider's floors from the deployment."""
    floors = floors_of(deployment(served.extra.get("calibration", ref.calibration)))
    longest = max(settings.r_probes)
    out: dict[int, list[Outcome]] = {r: [] for r in settings.r_probes}
    for _ in range(settings.trials):
        cycles = []
        for _ in range(longest):
            picks = {c.id: rng.choice(served.greedy[c.id]) for c in ref.canaries}
            cycles.append({cid: (o, o) for cid, o in picks.items()})
        after = reference_outcomes(ref, cycles, floors, alpha)
        for r in settings.r_probes:
            out[r].append(after[r])
    return out


def exact_match(ref: Reference, served: Served, settings, alpha: float, rng: random.Random) -> dict:
    """Text only: any greedy text differs from the baseline's. Score: how many texts differ."""
    out: dict[int, list[Outcome]] = {r: [] for r in settings.r_probes}
    longest = max(settings.r_probes)
    for _ in range(settings.trials):
        # texts that differ from the baseline's, per cycle of one probe per canary
        moved = [
            sum(rng.choice(served.greedy[c.id]).text != ref.baseline[c.id].text for c in ref.canaries)
            for _ in range(longest)
        ]
        for r in settings.r_probes:
            n = sum(moved[:r])
            out[r].append(Outcome(n > 0, n))
    return out


# -- text two-sample (canaryd's sampled test) and the peers ----------------------------------------------
def two_sample_text(ref: Reference, served: Served, settings, alpha: float, rng: random.Random) -> dict:
    """r answers per prompt at T = 1 against r baseline answers: `sampled.answer_test` (TV distance,
    permutation p-value) per prompt, Bonferroni over the C prompts. Score: −(Bonferroni p)."""
    c = len(ref.canaries)
    level = alpha / c
    b = permutations_for(level)
    base = {cid: [answer(o) for o in obs] for cid, obs in ref.samples.items()}
    cur = {cid: [answer(o) for o in obs] for cid, obs in served.samples.items()}
    out: dict[int, list[Outcome]] = {}
    for r in settings.r_samples:
        out[r] = []
        for _ in range(settings.trials):
            tests = [
                answer_test(draw(base[cid], r, rng), draw(cur[cid], r, rng), level=level, permutations=b)
                for cid in base
            ]
            p = min(1.0, c * min(t.p_value for t in tests))
            out[r].append(Outcome(any(t.reject for t in tests), -p))
    return out


METHODS: dict[str, Method] = {
    "canaryd": canaryd_shipped,
    "canaryd teacher-forced": canaryd_forced,
    TRACKING_ROW: canaryd_tracking,
    REFERENCE_ROW: canaryd_reference,
    "exact text match": exact_match,
    "two-sample text (T=1)": two_sample_text,
}


# how many requests (and which kind of request) a test of budget r costs on the tested server
REQUESTS = {
    "canaryd": ("greedy", "C·r"),
    "canaryd teacher-forced": ("forced", "C·r"),
    TRACKING_ROW: ("tracking", "C·r"),
    REFERENCE_ROW: ("greedy", "C·r (+5·C·r on the reference)"),
    "exact text match": ("greedy", "C·r"),
    "two-sample text (T=1)": ("sample", "C·r (+C·r reference)"),
}
