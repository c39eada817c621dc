"""Kind ``scripted``: a fake backend that answers from its config, for fast tests and alert drills.

It goes through the real registry, config validation, resilience, probe pass, store and judgement, so
everything but the network is exercised. Answers are tokenised one character per token with logprobs
derived from a hash of (canary, position, character): stable across processes and restarts, like a
deterministic engine. ``changes`` script what moves and when, counted in cycles (snapshots: one per pass):

    [[backends]]
    name = "fake"
    kind = "scripted"
    answers = { arith-add = "42" }            # by canary id, or by a substring of the prompt
    [[backends.changes]]
    at = 3                                     # from the third pass on ...
    logprob_shift = -0.01                      # ... every logprob moves: a silent numerical shift
    stack = { "engine.dtype" = "bfloat16" }

Without an answer a canary gets its ``expect.answer`` (else ``ok``). ``distribution`` gives a sampled
canary (temperature > 0) weighted answers, drawn from its seed when it has one.

Noise. ``noise`` adds Gaussian noise of that sd to every logprob of every attempt (a plain non-exact
engine). ``noise_model`` serves the realistic model of `canaryd.backends.noise` instead (or as well): a
request takes one of a few numerical paths by the load and by the crowd it was released with (``CROWD``:
a crowded probe's batch), each bit-exact, with heavy tails, prefix-cache hits, greedy flips at near ties
and, for an API, text flips (docs/detection.md, "A realistic noise model"):

    noise_model = { preset = "gpu-bf16" }    # or gpu-fp16, gpu-fp32, batch-invariant, api
    # optional: paths = 4, load = 0.5, cache_hits = 0.5, ties = 0.0, text_flips = 0.24, scale = 1.0

A change's ``noise`` or ``noise_model`` replaces it from then on (more load, say); a fleet member may have
its own. A change's ``logprob_ramp`` is a slow drift: that many nats more every cycle from ``at`` on.
Every draw (the noise, the path, the fleet member, an unseeded sample) is fresh in every process, as a
real engine's is, unless ``seed`` pins it; the paths themselves are the same in every process, as a
restarted engine's are.

``logprobs = false`` answers without logprobs (Anthropic's or Gemini's OpenAI-compatible endpoints, most
OpenRouter providers): the observation is judged on text, unless ``require_logprobs = true`` (as a profile
with ``request.logprobs = "require"``) makes it a ``no_logprobs`` error. ``reasoning_tokens`` (all
canaries, or by canary id) reports hidden reasoning as OpenAI-style usage does (counted in
``completion_tokens`` too), each attempt drawn within ± ``reasoning_jitter`` of it; a change's
``reasoning_tokens`` replaces it (a provider silently lowering reasoning effort). ``reasoning_effort``
maps a request's effort to its reasoning tokens (``{ low = 100, high = 400 }``). ``wrong_rate`` answers
``wrong_answer`` instead of the script to that share of the requests, drawn per request (a provider wrong
by honest noise); a change's ``wrong_rate`` replaces it (the rate rises).

The kind can score (teacher forcing): a forced canary or a reference check gets the given continuation
back character by character, ranked against what the script would have answered (`Prober._scored`).

``tool_calls`` (by canary id) answers a canary that offers tools with that call; a change's ``tool_call``
replaces it (``no_tool_call = true``: answers with text instead). ``ignore`` lists request parameters the
server silently ignores (``max_tokens``: the answer is never cut; ``reasoning_effort``: the effort's
reasoning tokens are not applied), in the settings or from a change on.

``fleet`` makes one backend a load-balanced fleet: each request is answered by one member, picked at
random (seeded by ``seed``, weighted by ``weight``) or in turn (``fleet_pick = "round-robin"``), and each
member has its own fingerprint, per-response stack fields and logprob offset (another dtype), so its
answers come from its own serving configuration. A member's ``snapshot`` fields are what its endpoints
answer: the snapshot, read through the balancer, is one member's too (picked as a request is). A change with
``member`` changes that member alone (its ``stack`` that member's snapshot):

    [[backends.fleet]]
    name = "fp32"
    fingerprint = "vllm-fp32"
    [[backends.fleet]]
    name = "bf16"
    fingerprint = "vllm-bf16"
    logprob_shift = -0.03
    [[backends.changes]]
    at = 12
    member = "bf16"                            # only the bf16 server's weights moved
    logprob_shift = -0.2
"""

from __future__ import annotations

import json
import random
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from canaryd.backends import openai_wire as wire
from canaryd.backends import refusals
from canaryd.backends.base import CROWD, BackendSettings, BackendUnavailable
from canaryd.backends.noise import NoiseModel, Realistic, Route, Share, unit
from canaryd.backends.openai_request import request_body, request_hash
from canaryd.canaries import Canary
from canaryd.fields import Strict
from canaryd.observation import ErrorKind, Observation, TokenLogprob, ToolCall, utcnow

ENGINE_VERSION_FIELD = "scripted.version"
VERSION = "1"
Ignorable = Literal["max_tokens", "reasoning_effort"]


class ScriptedCall(Strict):
    """A tool call the scripted server answers with; ``arguments`` is the JSON text sent (may be broken)."""

    name: str
    arguments: str = "{}"


class Change(Strict):
    """From cycle ``at`` on (until ``until``, exclusive), how the listed canaries (default: all) differ."""

    at: Annotated[int, Field(ge=1)]
    until: Annotated[int, Field(ge=2)] | None = None
    canaries: tuple[str, ...] | None = None
    text: str | None = None  # the answer, replaced
    logprob_shift: float = 0.0  # added to every logprob (clamped at 0)
    logprob_ramp: float = 0.0  # nats added per cycle from ``at`` on (``at`` itself: one step): a slow drift
    noise: Annotated[float, Field(ge=0)] | None = None
    noise_model: NoiseModel | None = None  # replaces the realistic noise model (another load, say)
    fingerprint: str | None = None
    stack: dict[str, str] = Field(default_factory=dict)  # snapshot fields, added or replaced
    prompt_tokens_delta: int = 0  # e.g. a hidden system prompt
    logprobs: bool | None = None  # False: answers carry no logprobs
    refuse: Literal[refusals.PARAMS] | None = None  # an HTTP 400 unsupported_parameter on this parameter
    reasoning_tokens: Annotated[int, Field(ge=0)] | None = None  # the hidden reasoning tokens, replaced
    wrong_rate: Share | None = None  # the share of answers that are ``wrong_answer``, replaced
    error: ErrorKind | None = None  # every attempt fails so ...
    fail_attempts: Annotated[int, Field(ge=0)] | None = None  # ... or only the first N of each probe
    down: bool = False  # the snapshot fails: the backend is unreachable
    tool_call: ScriptedCall | None = None  # the tool call answered, replaced
    no_tool_call: bool = False  # a canary offering tools gets text, no call
    ignore: tuple[Ignorable, ...] = ()  # request parameters silently ignored from now on
    member: str | None = None  # only answers from this fleet member change

    def applies(self, cycle: int, canary_id: str | None = None) -> bool:
        in_time = self.at <= cycle and (self.until is None or cycle < self.until)
        return in_time and (canary_id is None or self.canaries is None or canary_id in self.canaries)


class Member(Strict):
    """One server of a load-balanced fleet: its own serving configuration."""

    name: str
    fingerprint: str | None = None  # None: the backend's
    stack: dict[str, str] = Field(default_factory=dict)  # per-response fields (``response.provider`` ...)
    snapshot: dict[str, str] = Field(default_factory=dict)  # what its endpoints answer (``metrics.*`` ...)
    logprob_shift: float = 0.0  # another dtype's numerics
    noise: Annotated[float, Field(ge=0)] | None = None  # None: the backend's
    noise_model: NoiseModel | None = None  # None: the backend's
    weight: Annotated[float, Field(gt=0)] = 1.0


class Settings(BackendSettings):
    kind: Literal["scripted"] = "scripted"
    model: str = "scripted"
    answers: dict[str, str] = Field(default_factory=dict)
    distribution: dict[str, dict[str, Annotated[float, Field(gt=0)]]] = Field(default_factory=dict)
    fingerprint: str = "fp_scripted"
    stack: dict[str, str] = Field(default_factory=dict)
    noise: Annotated[float, Field(ge=0)] = 0.0
    noise_model: NoiseModel | None = None
    seed: int | None = None  # None: fresh draws in every process
    latency_s: Annotated[float, Field(ge=0, le=60)] = 0.0
    logprobs: bool = True  # False: every answer comes without logprobs
    require_logprobs: bool = False  # an answer without logprobs is a `no_logprobs` error
    reasoning_tokens: Annotated[int, Field(ge=0)] | dict[str, Annotated[int, Field(ge=0)]] | None = None
    reasoning_jitter: Annotated[int, Field(ge=0)] = 0
    reasoning_effort: dict[str, Annotated[int, Field(ge=0)]] = Field(default_factory=dict)
    wrong_rate: Share = 0.0  # the share of answers that are ``wrong_answer`` (a provider wrong by noise)
    wrong_answer: str = "wrong"
    tool_calls: dict[str, ScriptedCall] = Field(default_factory=dict)
    ignore: tuple[Ignorable, ...] = ()
    changes: tuple[Change, ...] = ()
    fleet: tuple[Member, ...] = ()
    fleet_pick: Literal["random", "round-robin"] = "random"

    @model_validator(mode="after")
    def _members_named(self) -> Settings:
        names = [m.name for m in self.fleet]
        if len(set(names)) != len(names):
            raise ValueError("fleet: member names must be distinct")
        for c in self.changes:
            if c.member is not None and c.member not in names:
                raise ValueError(
                    f"changes: member {c.member!r} is not in fleet ({', '.join(names) or 'none'})"
                )
        return self

    # Where the cycle count persists, so that separate `canaryd check` processes count on (default: the
    # count lives in the process, from 0).
    cycle_file: Path | None = None

    @property
    def scores(self) -> bool:
        return True  # a forced canary or a reference check: see `Prober._scored`


def _refusal(param: str) -> str:
    """The body OpenAI answers a parameter a model does not take with (tests/fixtures/refusals/)."""
    message = f"Unsupported parameter: '{param}' is not supported with this model."
    error = {"message": message, "type": "invalid_request_error", "param": param}
    return json.dumps({"error": {**error, "code": "unsupported_parameter"}})


class Prober:
    def __init__(self, cfg: Settings) -> None:
        self.cfg = cfg
        self.name, self.kind, self.concurrency = cfg.name, "scripted", cfg.concurrency
        self.cycle = 0
        self._attempts: dict[tuple[int, str], int] = {}
        self._draws = 0
        self._nth: dict[str, int] = {}
        self._lock = threading.Lock()
        # the noise differs between processes, as a real engine's does, unless the seed pins it
        self.seed = cfg.seed if cfg.seed is not None else secrets.randbits(64)
        self._models: dict[NoiseModel, Realistic] = {}

    def close(self) -> None:
        pass

    def _active(self, canary_id: str | None = None) -> list[Change]:
        return [c for c in self.cfg.changes if c.applies(max(1, self.cycle), canary_id)]

    def snapshot(self) -> dict[str, str]:
        with self._lock:
            f = self.cfg.cycle_file
            if f is not None:
                self.cycle = int(f.read_text() or 0) if f.exists() else 0
            self.cycle += 1
            if f is not None:
                f.write_text(str(self.cycle))
            # attempts are counted per cycle: a drill daemon running for days keeps only this one's
            self._attempts = {k: n for k, n in self._attempts.items() if k[0] >= self.cycle}
        member = self._member(self.cycle, "snapshot")  # behind a balancer the snapshot is one member's too
        fields = {"backend.kind": self.kind, "request.model": self.cfg.model, "scripted.version": VERSION}
        fields.update(self.cfg.stack)
        fields.update(member.snapshot if member else {})
        for change in self._active():
            if change.down:
                raise BackendUnavailable(ErrorKind.CONNECT, f"scripted backend {self.name!r} is down")
            if change.member is None or (member and change.member == member.name):
                fields.update(change.stack)
        return fields

    def request(self, canary: Canary) -> dict:
        body = request_body(self.cfg.model, canary)
        return body if canary.continuation is None else {**body, "continuation": canary.continuation}

    def request_hash(self, canary: Canary) -> str:
        return request_hash(self.request(canary))

    def attempt(self, canary: Canary) -> Observation:
        body = self.request(canary)
        obs = Observation(self.name, canary.id, canary.suite, utcnow(), body, request_hash(body))
        with self._lock:
            key = (self.cycle, f"{canary.id}\x1f{obs.request_hash}")
            n = self._attempts[key] = self._attempts.get(key, 0) + 1
            self._draws += 1
            draw = self._draws
            # the canary's own count seeds its noise: the order threads reach the kind in must not change
            # what a seed pins
            nth = self._nth[canary.id] = self._nth.get(canary.id, 0) + 1
        member = self._member(draw)
        active = [
            c for c in self._active(canary.id) if c.member is None or (member and c.member == member.name)
        ]
        time.sleep(self.cfg.latency_s)
        obs.latency_s = self.cfg.latency_s
        for change in active:
            if change.refuse is not None:  # OpenAI's body for a refused parameter, classified as a real one
                obs.error_kind, obs.error = refusals.classify(400, _refusal(change.refuse), self.name)
                return obs
            if change.error is not None and (change.fail_attempts is None or n <= change.fail_attempts):
                obs.error_kind, obs.error = change.error, f"scripted {change.error.value}"
                if change.error is ErrorKind.RATE_LIMITED:
                    obs.headers = {"retry-after": "0"}
                return obs
        if canary.continuation is not None:
            return self._scored(canary, active, obs, member)
        ignored = {*self.cfg.ignore, *(p for c in active for p in c.ignore)}
        calls = self._calls(canary, active)
        text = wire.with_calls(None, calls) if calls else self._answer(canary, active, nth)
        wrong = next((c.wrong_rate for c in reversed(active) if c.wrong_rate is not None), None)
        wrong = self.cfg.wrong_rate if wrong is None else wrong
        if not calls and wrong and random.Random(f"{self.seed}:{canary.id}:{nth}:wrong").random() < wrong:
            text = self.cfg.wrong_answer
        obs.tool_calls = calls
        shift, noise, model = self._shift_noise(active, member)
        rng = random.Random(f"{self.seed}:{canary.id}:{nth}")
        route, ties = None, {}
        if model is not None:
            route = model.draw(random.Random(f"{self.seed}:{canary.id}:{nth}:route"), CROWD.get())
            text, ties = (text, {}) if calls else model.answer(canary.id, text, route)
        d = canary.decoding
        chars = list(text) if "max_tokens" in ignored else list(text)[: d.max_tokens]
        moved = _moved(canary.id, model, route)
        obs.tokens = [
            self._token(canary.id, i, ch, d.top_logprobs, shift, noise, rng, moved, ties.get(i))
            for i, ch in enumerate(chars)
        ]
        obs.text = "".join(chars)
        obs.finish_reason = "length" if len(chars) < len(text) else "stop"
        prompt = canary.prompt or "".join(m.content for m in canary.messages or ())
        obs.prompt_tokens = len(prompt) + sum(c.prompt_tokens_delta for c in active)
        effort = None if "reasoning_effort" in ignored else d.reasoning_effort
        obs.reasoning_tokens = self._reasoning(canary.id, active, rng, effort)
        obs.completion_tokens = len(chars) + (obs.reasoning_tokens or 0)
        self._identify(obs, active, member)
        logprobs = next((c.logprobs for c in reversed(active) if c.logprobs is not None), self.cfg.logprobs)
        if not logprobs:
            obs.tokens, obs.has_logprobs = [], False
            if self.cfg.require_logprobs:
                obs.error_kind, obs.error = ErrorKind.NO_LOGPROBS, "response carries no logprobs"
        return obs

    def _shift_noise(
        self, active: list[Change], member: Member | None
    ) -> tuple[float, float, Realistic | None]:
        """The shift, the Gaussian sd and the realistic model that apply: a change's, else the member's,
        else the backend's."""
        shift = sum(c.logprob_shift + c.logprob_ramp * (max(1, self.cycle) - c.at + 1) for c in active)
        shift += member.logprob_shift if member else 0.0
        own = member.noise if member and member.noise is not None else self.cfg.noise
        noise = next((c.noise for c in reversed(active) if c.noise is not None), own)
        cfg = member.noise_model if member and member.noise_model is not None else self.cfg.noise_model
        cfg = next((c.noise_model for c in reversed(active) if c.noise_model is not None), cfg)
        if cfg is None:
            return shift, noise, None
        with self._lock:
            if (model := self._models.get(cfg)) is None:
                model = self._models[cfg] = Realistic(cfg)
        return shift, noise, model

    def _identify(self, obs: Observation, active: list[Change], member: Member | None) -> None:
        """The fingerprint and stack fields of the server (fleet member) that answered."""
        own_fp = member.fingerprint if member and member.fingerprint is not None else self.cfg.fingerprint
        fingerprint = next((c.fingerprint for c in reversed(active) if c.fingerprint), own_fp)
        obs.system_fingerprint, obs.response_model = fingerprint, self.cfg.model
        obs.stack = {"response.model": self.cfg.model, "response.system_fingerprint": fingerprint}
        obs.stack.update(member.stack if member else {})

    def _member(self, draw: int, stream: str = "fleet") -> Member | None:
        """The fleet member that answers the ``draw``-th request of ``stream`` (the probes', or the
        snapshots': one per cycle) (None: no fleet)."""
        fleet = self.cfg.fleet
        if not fleet:
            return None
        if self.cfg.fleet_pick == "round-robin":
            return fleet[(draw - 1) % len(fleet)]
        rng = random.Random(f"{self.seed}:{stream}:{draw}")
        return rng.choices(fleet, weights=[m.weight for m in fleet])[0]

    # -- scoring: teacher forcing a given continuation (forced canaries, reference checks) ------------
    def _scored(
        self, canary: Canary, active: list[Change], obs: Observation, member: Member | None
    ) -> Observation:
        """The continuation scored character by character. The model's own answer (what it would say: its
        script) ranks first at each position while the continuation follows it; a character off that
        answer (or after the two parted) gets a lower logprob, by a stable penalty of 1 to 4 nats."""
        assert canary.continuation is not None
        own = self._answer(canary.model_copy(update={"continuation": None}), active, 0)
        shift, noise, model = self._shift_noise(active, member)
        rng = random.Random(f"{self.seed}:{canary.id}:forced:{self._draws}")
        route = (
            model.draw(random.Random(f"{self.seed}:{canary.id}:forced:{self._draws}:route"), CROWD.get())
            if model
            else None
        )
        moved = _moved(canary.id, model, route)
        k, tokens, on_track = canary.decoding.top_logprobs, [], True
        for i, ch in enumerate(canary.continuation):
            on_track = on_track and i < len(own) and own[i] == ch
            top = self._token(canary.id, i, own[i] if i < len(own) else ch, k, shift, noise, rng, moved)
            if on_track:
                tokens.append(top)
                continue
            lp = min(0.0, top.logprob - 1.0 - 3.0 * unit(canary.id, i, ch, "off"))
            tokens.append(TokenLogprob(ch, lp, ord(ch), tuple(ch.encode()), top.top))
        obs.tokens, obs.text, obs.finish_reason = tokens, canary.continuation, "forced"
        prompt = canary.prompt or "".join(m.content for m in canary.messages or ())
        obs.prompt_tokens, obs.completion_tokens = len(prompt), len(tokens)
        self._identify(obs, active, member)
        return obs

    def _calls(self, canary: Canary, active: list[Change]) -> tuple[ToolCall, ...] | None:
        if canary.tools is None or any(c.no_tool_call for c in active):
            return None
        call = next((c.tool_call for c in reversed(active) if c.tool_call is not None), None)
        call = call or self.cfg.tool_calls.get(canary.id)
        return None if call is None else (ToolCall(call.name, call.arguments),)

    def _reasoning(
        self, canary_id: str, active: list[Change], rng: random.Random, effort: str | None = None
    ) -> int | None:
        base = self.cfg.reasoning_tokens
        n = base.get(canary_id) if isinstance(base, dict) else base
        n = self.cfg.reasoning_effort.get(effort, n) if effort is not None else n
        n = next((c.reasoning_tokens for c in reversed(active) if c.reasoning_tokens is not None), n)
        if n is None or not self.cfg.reasoning_jitter:
            return n
        return max(0, n + rng.randint(-self.cfg.reasoning_jitter, self.cfg.reasoning_jitter))

    def _answer(self, canary: Canary, active: list[Change], draw: int) -> str:
        scripted = next((c.text for c in reversed(active) if c.text is not None), None)
        if scripted is not None:
            return scripted
        d = canary.decoding
        weights = self.cfg.distribution.get(canary.id)
        if weights and d.temperature > 0:
            rng = random.Random(
                f"{canary.id}:{d.seed}" if d.seed is not None else f"{self.seed}:{canary.id}:#{draw}"
            )
            return rng.choices(list(weights), weights=list(weights.values()))[0]
        if canary.id in self.cfg.answers:
            return self.cfg.answers[canary.id]
        prompt = canary.prompt or " ".join(m.content for m in canary.messages or ())
        for needle, answer in self.cfg.answers.items():
            if needle in prompt:
                return answer
        return canary.expect.answer if canary.expect and canary.expect.answer else "ok"

    @staticmethod
    def _token(
        cid: str,
        i: int,
        ch: str,
        k: int,
        shift: float,
        noise: float,
        rng: random.Random,
        moved: Callable[[int, str], float] | None = None,
        tie: tuple[str, str, float] | None = None,
    ) -> TokenLogprob:
        """``ch`` at position i with its top-k: alternatives 1 nat apart, or at a near tie (leader, runner-up,
        gap) the runner-up ``gap`` below the leader (``ch`` is the one of them that won)."""

        def lp(token: str, base: float) -> float:
            off = moved(i, token) if moved else 0.0
            return min(0.0, base + shift + off + (rng.gauss(0.0, noise) if noise else 0.0))

        leader = tie[0] if tie else ch
        base = -0.05 - 2.0 * unit(cid, i, leader)
        alternatives = [chr(0x61 + int(26 * unit(cid, i, leader, j))) for j in range(k)]
        entries = [(leader, base)] + [
            (a, base - 1.0 - j) for j, a in enumerate(alternatives[: max(0, k - 1)])
        ]
        if tie:
            entries[1:2] = [(tie[1], base - tie[2])]
            if ch == tie[1]:
                entries[:2] = entries[1::-1]
        top = [(t, lp(t, b)) for t, b in entries]
        return TokenLogprob(ch, top[0][1], ord(ch), tuple(ch.encode()), tuple(top[:k]))


def _moved(cid: str, model: Realistic | None, route: Route | None) -> Callable[[int, str], float] | None:
    """Position, token → the realistic model's offset on this request's route (None: no model)."""
    if model is None or route is None:
        return None
    return lambda i, token: model.offset(cid, i, token, route)
