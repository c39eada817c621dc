"""A realistic noise model: what a GPU engine or a cloud API does to one greedy request's logprobs and text.

The `scripted` kind serves it (``noise_model = { preset = "gpu-bf16" }``) and the detection bench's shim
applies its offsets to real logprobs. docs/detection.md ("A realistic noise model") gives each figure's
source. It is not Gaussian noise with one sd, which is too kind to a nearest-neighbour statistic:

* **Paths.** A request's batch holds the crowd it was sent with (the ``crowd − 1`` requests released at
  once beside it: first contact's, learning's and calibration's crowded probes, `canaryd.probe.batching`)
  and the background: each of ``paths − 1`` slots taken with probability ``load``. Each number k of other
  requests is one numerical path, and k ≥ ``paths − 1`` share the last one, so the mix of paths follows the
  load (load 0: a request sent alone always takes path 0, as an idle server serves batch size 1), and a
  crowded request takes another path than one sent alone whatever the load, as on a real GPU engine. It
  also hits the prefix cache with probability ``cache_hits``.
* **Fixed per path.** Every (canary, position, token) has a fixed offset on each path: re-running the
  same batch is bit-exact, and a restarted engine (another process) has the same paths. Between two
  paths a share ``tail_share`` of the tokens moves by a heavy-tailed amount (bf16: 0.15–0.5 nats, so more
  than 0.1), the rest by a log-uniform tiny one. No offset exceeds ``CAP`` nats: the top-k order of a
  canary's answer (alternatives 1 nat apart) never changes off a near tie.
* **Cache.** A hit moves every logprob by at most 5e-3 nats (less where the preset's numerics are finer)
  and never reorders the top-5.
* **Near ties.** A share ``ties`` of the answer's positions has its runner-up within one bf16 ulp (0.25
  nats) of the chosen token; there the path (and the cache state) decides which wins, within the preset's
  ``tie_window``, and after a flip the text changes from there on (a fixed tail per flip).
* **Text flips.** A share ``text_flips`` of the requests leaves the script for one of two alternative
  texts, fixed per canary (each diverges at its own position): an API at T = 0.
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
from dataclasses import dataclass
from typing import Annotated, Literal, NamedTuple

from pydantic import Field

from canaryd.fields import Strict

Preset = Literal["gpu-bf16", "gpu-fp16", "gpu-fp32", "batch-invariant", "api"]
ULP = 0.25  # nats: one bf16 ulp of a logit in [32, 64); a runner-up this close is a near tie
CACHE_MAX = 5e-3  # nats: the largest move a prefix-cache hit makes
CAP = 0.45  # nats: the largest offset; two never add up to the 1-nat gap between the top-k alternatives
VARIANTS = 2  # the alternative texts a flipping API answers with


@dataclass(frozen=True)
class Numerics:
    """One preset's figures (docs/detection.md gives the source of each)."""

    paths: int
    tail_share: float  # share of tokens two paths move by a tail offset
    tail: tuple[float, float]  # nats: the range of a tail offset (log-uniform)
    body: tuple[float, float]  # nats: the range of every other offset (log-uniform)
    tie_window: float  # nats: how far a path can move a near tie's margin
    text_flips: float  # share of requests whose text leaves the script


PRESETS: dict[str, Numerics] = {
    "gpu-bf16": Numerics(4, 0.08, (0.15, CAP), (1e-4, 0.05), ULP, 0.0),
    "gpu-fp16": Numerics(4, 7e-4, (0.15, CAP), (1e-5, 6e-3), ULP / 8, 0.0),
    "gpu-fp32": Numerics(4, 0.0, (0.15, CAP), (1e-7, 1e-5), 1e-5, 0.0),
    "batch-invariant": Numerics(4, 1e-3, (1e-3, 6.7e-2), (1e-7, 1e-5), 6.7e-2, 0.0),
    "api": Numerics(8, 0.08, (0.15, CAP), (1e-4, 0.05), ULP, 0.24),
}

Share = Annotated[float, Field(ge=0, le=1)]


class NoiseModel(Strict):
    """``noise_model = { preset = "gpu-bf16", load = 0.5, ... }``: a preset and what to change of it."""

    preset: Preset
    paths: Annotated[int, Field(ge=1, le=64)] | None = None  # None: the preset's
    load: Share = 0.5  # how full the batches run: the mix of paths
    cache_hits: Share = 0.5  # share of requests served from a cached prefix
    ties: Share = 0.0  # share of answer positions whose runner-up is a near tie
    text_flips: Share | None = None  # None: the preset's
    scale: Annotated[float, Field(ge=0)] = 1.0  # every offset, times this (capped at CAP)


class Route(NamedTuple):
    """How one request was served: its numerical path, a prefix-cache hit, the text variant (0: none)."""

    path: int
    cache: bool
    variant: int = 0


def units(*parts: object) -> tuple[float, float, float, float]:
    """Four stable numbers in [0, 1) from their parts (the same in every process, unlike ``hash``)."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    a, b, c, d = (int.from_bytes(digest[j : j + 8], "big") / 2**64 for j in range(0, 32, 8))
    return a, b, c, d


def unit(*parts: object) -> float:
    """A stable number in [0, 1) from its parts."""
    return units(*parts)[0]


def letter(*parts: object, avoid: str = "") -> str:
    """A stable lowercase letter from its parts, never ``avoid``."""
    c = chr(0x61 + int(26 * unit(*parts)))
    return c if c != avoid else chr(0x61 + (ord(c) - 0x60) % 26)


def runner_up(cid: str, i: int, ch: str) -> str:
    """The token second to ``ch`` at position i (the scripted kind's first alternative, never ``ch``)."""
    return letter(cid, i, ch, 0, avoid=ch)


def _log_uniform(lo: float, hi: float, u: float) -> float:
    return lo * (hi / lo) ** u


class Realistic:
    """The model of one configuration. ``key`` names an engine's numerics: the scripted kind's are always
    the same (a restart keeps them); the bench's shim draws a key per simulated deployment."""

    def __init__(self, cfg: NoiseModel, key: str = "") -> None:
        self.cfg, self.key = cfg, key
        n = PRESETS[cfg.preset]
        self.numerics = n
        self.paths = cfg.paths or n.paths
        self.text_flips = n.text_flips if cfg.text_flips is None else cfg.text_flips
        # each path's token is in the tail with probability q, so two paths differ in it with tail_share
        self._q = 1.0 - math.sqrt(1.0 - n.tail_share)
        self._cache_max = min(CACHE_MAX, n.body[1])

    def draw(self, rng: random.Random, crowd: int = 1) -> Route:
        """The route of one request sent with ``crowd − 1`` others at once, drawn from the load, the cache
        hit rate and the text flip rate."""
        background = sum(rng.random() < self.cfg.load for _ in range(self.paths - 1))
        path = min(self.paths - 1, crowd - 1 + background)
        cache = rng.random() < self.cfg.cache_hits
        flips = rng.random() < self.text_flips
        return Route(path, cache, 1 + rng.randrange(VARIANTS) if flips else 0)

    def offset(self, cid: str, i: int, token: str, route: Route) -> float:
        """The fixed offset in nats of ``token``'s logprob at position i on this route."""
        return self._offset(cid, i, token, route.path, route.cache)

    @functools.lru_cache(maxsize=1 << 16)  # noqa: B019 (a model lives as long as its backend)
    def _offset(self, cid: str, i: int, token: str, path: int, cache: bool) -> float:
        tail, size, sign, _ = units(self.key, cid, i, token, path)
        lo, hi = self.numerics.tail if tail < self._q else self.numerics.body
        off = _log_uniform(lo, hi, size) * (1.0 if sign < 0.5 else -1.0)
        if cache:
            size, sign, _, _ = units(self.key, cid, i, token, "hit")
            off += _log_uniform(self._cache_max / 500, self._cache_max, size) * (1.0 if sign < 0.5 else -1.0)
        return max(-CAP, min(CAP, off * self.cfg.scale))

    def tie(self, cid: str, i: int, ch: str) -> float | None:
        """The margin in nats of the near tie at position i whose leader is ``ch`` (None: no tie): a
        property of the answer, the same on every route."""
        if unit(cid, i, ch, "tie") >= self.cfg.ties:
            return None
        return ULP * unit(cid, i, ch, "margin")

    def gap(self, cid: str, i: int, ch: str, margin: float, route: Route) -> float:
        """The runner-up's distance below ``ch`` on this route before token offsets: the margin moved by
        up to ± tie_window, a fixed draw per (path, cache state)."""
        u = unit(self.key, cid, i, ch, route.path, route.cache, "contest")
        return margin - self.numerics.tie_window * self.cfg.scale * (2.0 * u - 1.0)

    def answer(self, cid: str, script: str, route: Route) -> tuple[str, dict[int, tuple[str, str, float]]]:
        """The text this route answers, and each near tie on it by position: (leader, runner-up, gap)."""
        text = script
        if route.variant and script:
            at = int(len(script) * unit(cid, route.variant, "variant-at"))
            first = letter(cid, at, route.variant, "variant", avoid=script[at])
            text = script[:at] + first + _tail(cid, at, first, len(script) - at - 1)
        ties: dict[int, tuple[str, str, float]] = {}
        for i in range(len(text)):
            ch = text[i]
            margin = self.tie(cid, i, ch)
            if margin is None:
                continue
            rival, gap = runner_up(cid, i, ch), self.gap(cid, i, ch, margin, route)
            ties[i] = (ch, rival, gap)
            if self.offset(cid, i, rival, route) - gap > self.offset(cid, i, ch, route):
                text = text[:i] + rival + _tail(cid, i, rival, len(text) - i - 1)
        return text, ties


def _tail(cid: str, i: int, after: str, n: int) -> str:
    """What follows a divergence at position i to ``after``: a fixed text of n letters."""
    return "".join(letter(cid, i, after, j, "tail") for j in range(n))
