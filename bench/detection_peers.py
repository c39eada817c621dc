"""The detection bench's peer rows, each as its authors run it where the testbed allows (`peers.py` holds
the statistics; the citations are there):

- LT, scored by its statistic (its paper's AUC), its permutation p-value deciding at alpha, with two
  companion rows from the same trials: the AUC by −p (what the bench used to rank it by) and its
  production rule (12σ over the 100 tests before, 48 left out, statistic > 1.0). Its reference window is
  what canaryd's calibration gets: K·C probes (the same days under the shim), taken where canaryd is
  deployed (through the balancer on the fleet). Its windows: N = C·r (equal requests), its paper's N = 10,
  and N of equal tokens to each canaryd mode's test.
- Token-DiFR at T = 0: the greedy margin of each canaryd answer's tokens under the reference's scoring, the
  test's mean margin against the largest mean margin of the deployment's honest calibration answers.
- the MET kernel on the bench's six short canaries: MET's statistic, not MET's settings (25 open-ended
  prompts, 10 samples each, completions of 50 tokens or more), so it is named for what it is.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from functools import cache, partial

import numpy as np

from bench.detection_lab import MAX_TOKENS, Served, check_key, mean_tokens
from bench.detection_methods import Outcome, Reference, draw, permutations_for
from bench.peers import (
    LT_ABSOLUTE,
    LT_HISTORY,
    difr_score,
    lt_production_alarm,
    lt_statistic,
    lt_test,
    met_test,
)
from canaryd.observation import Observation, TokenLogprob

LT = "LT (top-20, 1 token; by its statistic)"
LT_P = "LT, ranked by −p"
LT_PROD = "LT production rule (12σ/100/48, > 1.0)"
DIFR = "Token-DiFR (T=0 greedy margin)"
MET = "MET kernel, 6 short canaries (not MET's settings)"
LT_PAPER_N = 10  # LT's paper: N = 10 requests per window


def lt_row(obs: Observation) -> dict[str, float]:
    """One LT row: the top-k logprobs of the single generated token."""
    return dict(obs.tokens[0].top)


def lt_windows(ref: Reference, settings) -> dict[float, int]:
    """LT's window sizes, keyed by r = N / C (requests per canary-equivalent, so the tables can set them
    beside the canaryd budgets): C·r for every request budget, its paper's N = 10, and the N whose tokens
    equal a canaryd mode's test at each budget (tokens measured on the baseline server; up to
    ``settings.lt_max_n`` rows)."""
    c = len(ref.canaries)
    sizes = {c * r for r in settings.r_probes} | {LT_PAPER_N}
    lt_tok = mean_tokens(ref.lt)
    for probes in (ref.calibration, ref.forced_calibration, ref.tracking_calibration):
        per = [o for obs in probes.values() for o in obs]
        if per and lt_tok > 0 and (tok := mean_tokens(per)) > 0:
            matched = (math.floor(c * r * tok / lt_tok) for r in settings.r_probes)
            sizes |= {n for n in matched if 1 <= n <= settings.lt_max_n}
    return {n / c: n for n in sorted(sizes)}


def lt_reference(ref: Reference, served: Served) -> list[Observation]:
    """The pool LT's deployment draws its reference from: the baseline server's, or (deployed on a fleet)
    what the balancer gave when it was deployed."""
    return served.extra.get("lt calibration", {}).get("lt", ref.lt)


def lt_outcome(
    window1: list[dict[str, float]],
    window2: list[dict[str, float]],
    history: Callable[[], Sequence[float]],
    alpha: float,
    permutations: int,
    npr: np.random.Generator,
) -> Outcome:
    """One LT test and its companions. ``history`` is asked for only where the production rule could
    alarm (a statistic above LT_ABSOLUTE), so the honest history is drawn only where it matters."""
    t = lt_test(window1, window2, permutations=permutations, rng=npr)
    prod = t.statistic > LT_ABSOLUTE and lt_production_alarm(history(), t.statistic)
    also = ((LT_P, Outcome(t.p_value <= alpha, -t.p_value)), (LT_PROD, Outcome(prod, t.statistic)))
    return Outcome(t.p_value <= alpha, t.statistic, also)


def lt_method(ref: Reference, served: Served, settings, alpha: float, rng: random.Random) -> dict:
    """LT deployed where canaryd is: a reference window of K·C probes from the deployment's pool, a history
    of LT_HISTORY honest tests (reference against a window of the same pool) for its production rule, then
    per trial a window of N probes from the tested server."""
    npr = np.random.default_rng(rng.getrandbits(63))
    pool = lt_reference(ref, served)
    w1 = [lt_row(o) for o in draw(pool, ref.k * len(ref.canaries), rng)]
    b = permutations_for(alpha, settings.permutation_floor)
    out: dict[float, list[Outcome]] = {}
    for r, n in lt_windows(ref, settings).items():
        history = cache(partial(_history, w1, pool, n, rng))
        out[r] = [
            lt_outcome(w1, [lt_row(o) for o in draw(served.lt, n, rng)], history, alpha, b, npr)
            for _ in range(settings.trials)
        ]
    return out


def _history(w1: list, pool: list[Observation], n: int, rng: random.Random) -> list[float]:
    """LT_HISTORY honest statistics before a test: the reference against a window of its own pool."""
    return [lt_statistic(w1, [lt_row(o) for o in draw(pool, n, rng)]) for _ in range(LT_HISTORY)]


# -- Token-DiFR ------------------------------------------------------------------------------------------
def positions(scored: Sequence[TokenLogprob]) -> list[tuple[dict[str, float], str]]:
    """The reference's scoring of an answer as Token-DiFR's (verifier logprobs, provider's token) pairs: the
    top-k the reference ranked, and the forced token itself at its own logprob."""
    return [(dict(t.top) | {t.token: t.logprob}, t.token) for t in scored]


def difr_answers(ref: Reference, answers: Sequence[Observation]) -> list[tuple[float, int]]:
    """(summed greedy margin, tokens) per answer, from the reference's scoring of its text. Scorings are
    looked up by text (the margin reads tokens only), so honest calibration answers find theirs among
    the tested servers' identical ones."""
    by_text = {(k[0], k[1]): v for k, v in ref.scored.items()}
    out = []
    for o in answers:
        scored = ref.scored.get(check_key(o)) or by_text.get((o.canary_id, o.text or ""))
        if scored is None:
            raise SystemExit(f"detection bench: no reference scoring of {o.canary_id}'s answer {o.text!r}")
        out.append((difr_score(positions(scored)) * len(scored), len(scored)) if scored else (0.0, 0))
    return out


def difr_method(ref: Reference, served: Served, settings, alpha: float, rng: random.Random) -> dict:
    """Token-DiFR on canaryd's greedy answers (C·r a test): the mean margin over the test's tokens, against
    the largest mean margin of one honest calibration answer of the deployment (its bar: the honest
    engine's own margins; 0 on a deterministic one). Score: the mean margin."""
    calibration = served.extra.get("calibration", ref.calibration)
    honest = difr_answers(ref, [o for obs in calibration.values() for o in obs])
    bar = max((s / n for s, n in honest if n), default=0.0)
    pools = {c.id: difr_answers(ref, served.greedy[c.id]) for c in ref.canaries}
    longest = max(settings.r_probes)
    out: dict[int, list[Outcome]] = {r: [] for r in settings.r_probes}
    for _ in range(settings.trials):
        cycles = [[rng.choice(pools[c.id]) for c in ref.canaries] for _ in range(longest)]
        for r in settings.r_probes:
            s = sum(m for cycle in cycles[:r] for m, _ in cycle)
            n = sum(k for cycle in cycles[:r] for _, k in cycle)
            score = s / n if n else 0.0
            out[r].append(Outcome(score > bar, score))
    return out


# -- the MET kernel --------------------------------------------------------------------------------------
class Codes(dict):
    """Token → integer code, the same across servers (MET compares completions position by position)."""

    def of(self, obs: Observation) -> list[int]:
        return [self.setdefault(t.token, len(self)) for t in obs.tokens]


CODES = Codes()


def met_method(ref: Reference, served: Served, settings, alpha: float, rng: random.Random) -> dict:
    """MET's statistic at an equal request budget: r completions per prompt at T = 1 (C prompts, MAX_TOKENS
    tokens) against r from the baseline server, Hamming MMD² with within-prompt permutations. Score: −p."""
    npr = np.random.default_rng(rng.getrandbits(63))
    b = permutations_for(alpha, settings.permutation_floor)
    base = {cid: [CODES.of(o) for o in obs] for cid, obs in ref.samples.items()}
    cur = {cid: [CODES.of(o) for o in obs] for cid, obs in served.samples.items()}
    out: dict[int, list[Outcome]] = {}
    for r in settings.r_samples:
        out[r] = []
        for _ in range(settings.trials):
            s1 = {cid: draw(x, r, rng) for cid, x in base.items()}
            s2 = {cid: draw(cur[cid], r, rng) for cid in base}
            t = met_test(s1, s2, MAX_TOKENS, permutations=b, rng=npr)
            out[r].append(Outcome(t.p_value <= alpha, -t.p_value))
    return out


PEERS = {LT: lt_method, DIFR: difr_method, MET: met_method}

# requests per test on the tested server (kind of request, and what it costs besides)
PEER_REQUESTS = {
    LT: ("lt", "C·r"),
    LT_P: ("lt", "C·r"),
    LT_PROD: ("lt", "C·r"),
    DIFR: ("greedy", "C·r (+C·r scorings on the reference)"),
    MET: ("sample", "C·r (+C·r reference)"),
}


def split(cells: dict) -> dict:
    """The companion rows an outcome carries (`Outcome.also`) as rows of their own, the same trials."""
    out = dict(cells)
    for (_, variant), by_r in cells.items():
        for r, outcomes in by_r.items():
            for o in outcomes:
                for row, x in o.also:
                    out.setdefault((row, variant), {}).setdefault(r, []).append(x)
    return out
