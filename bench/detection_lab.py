"""The detection bench's testbed: the tiny trained model, real vLLM servers, what each server gave, and the
SYNTHETIC noise shim (the heterogeneous fleet is the harness's random balancer in front of two servers)."""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from canaryd.backends import Backend, make_backend, vllm_server
from canaryd.backends.noise import NoiseModel, Preset, Realistic, Route
from canaryd.canaries import Canary, Decoding, load_suite
from canaryd.config import CompareConfig
from canaryd.lab.tinymodel import build_tiny_model
from canaryd.lab.vllm_process import VLLMServer
from canaryd.observation import Observation, TokenLogprob
from canaryd.probe import vet
from canaryd.probe.reference import Check, check_one, scoring
from canaryd.probe.shapes import shape_of
from canaryd.stack import configuration_of

REPO = Path(__file__).resolve().parents[1]
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
HONEST = ("N0", "F")  # the restarts and the fleet serve the baseline's weights: every alarm is false
SHIM_MODES = 4
SHIM_JITTER = 0.15  # iid jitter as a share of σ_mode (0.003 vs 0.02 in docs/detection-research.md §2.4)
SHIM_CAL_DAYS = 4  # the calibration probes are spread over this many simulated days (mode mixes)


@dataclass
class Served:
    """What one server gave: greedy probes per canary (alone and crowded), temperature-1 samples per prompt
    and LT's one-token probes; tokens are the mean prompt + completion tokens per request of each kind."""

    variant: str
    greedy: dict[str, list[Observation]]
    samples: dict[str, list[Observation]]
    lt: list[Observation]
    tokens: float
    sample_tokens: float
    lt_tokens: float
    startup_s: float
    forced_tokens: float = 0.0  # per teacher-forced request
    tracking_tokens: float = 0.0  # per request of the shipped tracking suite
    # "forced", "tracking": those canaries' probes; on the fleet also "calibration", "forced calibration"
    # and "tracking calibration", the probes a canaryd deployed on the balancer calibrates from
    extra: dict[str, dict[str, list[Observation]]] = field(default_factory=dict)
    # suite → the product path's test passes on this server (`detection_product.Pass`)
    product: dict[str, list] = field(default_factory=dict)
    met: dict[str, list[tuple[str, ...]]] = field(default_factory=dict)  # `detection_met.completions`


def bench_canaries() -> list[Canary]:
    """Short known-answer canaries of the shipped suite: greedy, seed 0, top-5 logprobs, 12 tokens at most."""
    suite = load_suite(REPO / "canaries" / "default.toml")
    chosen = [c for c in suite.canaries if c.id in CANARY_IDS]
    return [
        c.model_copy(update={"decoding": c.decoding.model_copy(update={"max_tokens": MAX_TOKENS})})
        for c in chosen
    ]


# LT's probe as its paper sends it: the one-character prompt "x", one output token, the top-20 logprobs
def tracking_canaries() -> list[Canary]:
    """The shipped tracking suite as a user runs it: LT's probe shape as canaryd canaries."""
    return list(load_suite(REPO / "canaries" / "tracking.toml").canaries)


LT_CANARY = Canary(
    id="lt-x", prompt="x", decoding=Decoding(max_tokens=1, top_logprobs=20, temperature=0.0), suite="bench"
)


# Teacher-forced canaries: short raw prompts (no chat template), each scored on a fixed continuation of
# FORCED_CHARS characters, so one request is a few tokens and a test of C = 6 at r = 1 fits in 48
FORCED_PROMPTS = ("x", "2+3", "H2O", "Pa", "7*6", "To")
FORCED_CHARS = 3


def forced_canaries(backend: Backend) -> list[Canary]:
    """One forced canary per FORCED_PROMPTS, its continuation what ``backend`` (the baseline server) answers
    greedily: the known answer every other server's scoring of it is compared with."""
    out = []
    for i, prompt in enumerate(FORCED_PROMPTS):
        decoding = Decoding(max_tokens=FORCED_CHARS, top_logprobs=5, temperature=0.0)
        canary = Canary(id=f"forced-{i}", prompt=prompt, decoding=decoding, suite="bench")
        text = ok([backend.probe(canary)], canary.id)[0].text
        if not text:
            raise SystemExit(f"detection bench: the baseline server answers {prompt!r} with nothing")
        out.append(canary.model_copy(update={"continuation": text}))
    return out


def check_key(obs: Observation) -> tuple:
    """What a reference check depends on besides the reference: the canary, the text, its logprobs."""
    return obs.canary_id, obs.text or "", tuple((t.token_id, t.logprob) for t in obs.tokens)


def reference_checks(
    reference: Backend, canaries: Sequence[Canary], greedy: dict[str, list[Observation]]
) -> tuple[dict[tuple, Check], dict[tuple, tuple[TokenLogprob, ...]]]:
    """The reference check (`canaryd.probe.reference.check_one`) of every distinct greedy answer, by
    `check_key` (its logprobs are part of it: two servers' same text is two answers), and the reference's
    scoring of each answer's text (the shimmed reference row recomputes the answer's logprob gap from it)."""
    todo = {check_key(o): (c, o) for c in canaries for o in greedy[c.id]}

    def both(item: tuple[Canary, Observation]) -> tuple[Check, Observation]:
        c, o = item
        return check_one(reference, c, o), vet.probe(reference, scoring(c, o.text or ""))

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        done = dict(zip(todo, pool.map(both, todo.values()), strict=True))
    bad = [(key, c.error) for key, (c, _) in done.items() if c.error is not None or c.parting is None]
    bad += [(key, s.error) for key, (_, s) in done.items() if not s.ok]
    if bad:
        raise SystemExit(f"detection bench: {len(bad)} reference check(s) failed, e.g. {bad[0]}")
    return {k: c for k, (c, _) in done.items()}, {k: tuple(s.tokens) for k, (_, s) in done.items()}


# FT<lr>: one fine-tuning step (`tinymodel.finetune_step`) on this small batch of raw completions, none of
# them a canary's prompt: a provider's update on data of its own
FINETUNE_BATCH = (
    ("Once upon a time", " there was a small red fox."),
    ("The weather today is", " cold and wet."),
    ("My favourite food is", " bread with cheese."),
    ("The river flows", " to the sea."),
    ("Every morning she", " walks to the market."),
    ("The letter said", " come home soon."),
    ("The children played", " in the garden."),
    ("A good friend is", " always there."),
)


def trained_model(canaries: Sequence[Canary]) -> Path:
    pairs = [([m.model_dump() for m in c.messages or ()], c.expect.answer) for c in canaries if c.expect]
    return build_tiny_model(CACHE / "detection-trained-seed0", seed=0, train=pairs, steps=600)


def backend_for(base_url: str) -> Backend:
    cfg = vllm_server.Settings(
        name="bench", kind="vllm", base_url=base_url, model="tiny", concurrency=CONCURRENCY
    )
    return make_backend(cfg)


@contextmanager
def server(model: Path, dtype: str, logs: Path, name: str) -> Iterator[VLLMServer]:
    # every server serves its weights under one path, as a provider swaps weights behind one name: the stack
    # snapshot's models.root then names no variant (the product path's `check` reads it); a running server
    # has loaded its weights, so relinking for the next one leaves it as it is
    served = logs / "served-weights"
    served.unlink(missing_ok=True)
    served.symlink_to(model.resolve())
    # a long start-up allowance: one late start on a loaded machine would lose every server served before it
    with VLLMServer(
        served,
        dtype=dtype,
        extra_args=["--enforce-eager"],
        log_path=logs / f"{name}.log",
        startup_timeout=900,
    ) as srv:
        yield srv


@contextmanager
def serving(model: Path, dtype: str, logs: Path, name: str) -> Iterator[tuple[Backend, float]]:
    """A real vLLM server and canaryd's own backend for it (closed, and the server stopped, on exit)."""
    with server(model, dtype, logs, name) as srv:
        backend = backend_for(srv.base_url)
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


def lt_probes(backend: Backend, n: int) -> list[Observation]:
    """n of LT's one-token probes, CONCURRENCY in flight (its paper sends them one by one over time)."""
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        got = ok(list(pool.map(backend.probe, [LT_CANARY] * n)), "LT")
    if any(not o.tokens or not o.tokens[0].top for o in got):
        raise SystemExit("detection bench: an LT probe came back without top logprobs")
    return got


def mean_tokens(observations: Sequence[Observation]) -> float:
    return statistics.fmean((o.prompt_tokens or 0) + (o.completion_tokens or 0) for o in observations)


def mean_completion_tokens(observations: Sequence[Observation]) -> float:
    return statistics.fmean(o.completion_tokens or 0 for o in observations)


def collect(
    variant: str,
    backend: Backend,
    startup_s: float,
    canaries: Sequence[Canary],
    forced: Sequence[Canary],
    tracking: Sequence[Canary],
    settings,
    rng: random.Random,
) -> Served:
    greedy = greedy_probes(backend, canaries, settings.pool)
    samples = sampled(backend, canaries, settings.samples, rng)
    lt = lt_probes(backend, settings.lt_pool)
    scored = greedy_probes(backend, forced, settings.pool)
    track = greedy_probes(backend, tracking, settings.pool)
    return Served(
        variant,
        greedy,
        samples,
        lt,
        mean_tokens([o for obs in greedy.values() for o in obs]),
        mean_tokens([o for obs in samples.values() for o in obs]),
        mean_tokens(lt),
        startup_s,
        mean_tokens([o for obs in scored.values() for o in obs]),
        mean_tokens([o for obs in track.values() for o in obs]),
        {"forced": scored, "tracking": track},
    )


def composed(variant: str, fleet: Served, drop: str, joined: Served) -> Served:
    """A fleet whose member serving configuration ``drop`` was replaced by ``joined``'s server (the same
    configuration, other weights): the fleet's answers from its other members plus every answer ``joined``
    gave, in every pool, so each method sees it at the same budget; deployed on the fleet as before."""

    def mix(a: list[Observation], b: list[Observation]) -> list[Observation]:
        return [o for o in a if configuration_of(o.stack) != drop] + b

    def pools(a: dict[str, list[Observation]], b: dict[str, list[Observation]]) -> dict:
        return {cid: mix(a[cid], b[cid]) for cid in a}

    return replace(
        fleet,
        variant=variant,
        greedy=pools(fleet.greedy, joined.greedy),
        samples=pools(fleet.samples, joined.samples),
        lt=mix(fleet.lt, joined.lt),
        extra=fleet.extra | {k: pools(fleet.extra[k], joined.extra[k]) for k in ("forced", "tracking")},
        product={},  # `check` passes and MET's completions need a server: a composed fleet has none
        met={},
    )


class Shim:
    """SYNTHETIC mode-structured noise on real logprobs: the figures where the noise floor is not zero.

    Batched GPU serving does not jitter around one value; a request takes one of a few numerical paths
    (modes) whose mix follows the load (docs/detection-research.md §1.4, §2.4). Here each canary has
    SHIM_MODES modes; a simulated day draws the mode mix (Dirichlet(1)); each probe takes a mode from its
    day's mix. ``level`` a number: each mode is a fixed offset N(0, σ_mode = level) per (position, token)
    coordinate, plus iid jitter per probe. ``level`` a preset of the realistic noise model
    (`canaryd.backends.noise`, as the scripted kind serves it): each mode is one of its paths, bit-exact,
    with its heavy tails, and each probe hits the prefix cache at its rate; every deployment is a fresh
    engine (its own offsets). The chosen token and the same token among the top-k move together. Tokens
    never change (the model's near-tie and text flips are not applied), so the shim leaves the text-only
    methods as they are.
    """

    def __init__(self, level: float | Preset, rng: random.Random) -> None:
        self.sigma = level if isinstance(level, float | int) else 0.0
        self.rng = rng
        self.offsets: dict[tuple[str, int, int, str], float] = {}
        self.model = None
        if isinstance(level, str):
            cfg = NoiseModel(preset=level, paths=SHIM_MODES)
            self.model = Realistic(cfg, key=f"shim-{rng.getrandbits(64)}")

    def day(self) -> list[float]:
        weights = [self.rng.gammavariate(1.0, 1.0) for _ in range(SHIM_MODES)]
        return [w / sum(weights) for w in weights]

    def _shifter(self, obs: Observation, mix: Sequence[float]) -> Callable[[int, str], float]:
        """One probe's offsets: (position, token) → nats, from the mode its day's mix gives it."""
        mode = self.rng.choices(range(SHIM_MODES), weights=mix)[0]
        moved: dict[tuple[int, str], float] = {}
        model = self.model
        route = Route(mode, self.rng.random() < model.cfg.cache_hits) if model else None

        def shift(pos: int, token: str) -> float:
            if model is not None and route is not None:
                return model.offset(obs.canary_id, pos, token, route)
            if (pos, token) not in moved:
                key = (obs.canary_id, mode, pos, token)
                if key not in self.offsets:
                    self.offsets[key] = self.rng.gauss(0.0, self.sigma)
                moved[(pos, token)] = self.offsets[key] + self.rng.gauss(0.0, SHIM_JITTER * self.sigma)
            return moved[(pos, token)]

        return shift

    def __call__(self, obs: Observation, mix: Sequence[float]) -> Observation:
        shift = self._shifter(obs, mix)
        # a logprob stays ≤ 0: a near-certain token's noise is one-sided
        tokens = [  # built, not `replace`d: a shim analysis makes millions
            TokenLogprob(
                t.token,
                min(0.0, t.logprob + shift(i, t.token)),
                t.token_id,
                t.bytes,
                tuple((x, min(0.0, v + shift(i, x))) for x, v in t.top),
            )
            for i, t in enumerate(obs.tokens)
        ]
        return replace(obs, tokens=tokens)

    def first_top(self, obs: Observation, mix: Sequence[float]) -> dict[str, float]:
        """The first token's top-k as ``self(obs, mix)`` moves it (an LT row), without the rest."""
        shift = self._shifter(obs, mix)
        return {x: min(0.0, v + shift(0, x)) for x, v in obs.tokens[0].top}
