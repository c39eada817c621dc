"""What one probe saw: the typed record that flows from a backend to the store and the comparator.

Everything here is plain data. Backends build it, `canaryd.store` persists it, `canaryd.judge` reads it.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime


def utcnow() -> datetime:
    """Aware UTC now: every timestamp canaryd records (observations, runs, baselines) comes from here."""
    return datetime.now(UTC)


def canonical_digest(doc: object) -> str:
    """The SHA-256 (hex) of ``doc`` as canonical JSON (sorted keys, no spaces, UTF-8; anything JSON cannot
    hold as its ``str``): the store's content keys, a request body's (`Observation.request_ref`) and an
    outcome's. Stored keys are digests of these bytes: changing them would orphan every stored row."""
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class ErrorKind(enum.StrEnum):
    """Why a probe produced no usable answer. A bounded set, so it can be a metric label."""

    CONNECT = "connect"
    TIMEOUT = "timeout"
    RATE_LIMITED = "rate_limited"
    HTTP_4XX = "http_4xx"
    HTTP_5XX = "http_5xx"
    AUTH = "auth"
    INVALID_RESPONSE = "invalid_response"
    TRUNCATED = "truncated"  # the connection closed mid-body
    NO_LOGPROBS = "no_logprobs"  # the profile requires logprobs (``request.logprobs = "require"``); none came
    CONFIG = "config"  # refused as configured (unsupported parameter or value): fix the profile
    CIRCUIT_OPEN = "circuit_open"  # not sent: the backend failed repeatedly and is cooling down
    TOO_LARGE = "too_large"  # the answer passed a cap: body bytes, or more tokens than max_tokens asked
    CHECK_TIMEOUT = "check_timeout"  # the expected-answer check ran out of time (a backtracking regex)
    # A conformance canary could not show the server honours the parameter it varies: ignored (over the
    # limit, not cut, no effect), or not measurable (no reasoning tokens reported)
    NONCONFORMANT = "nonconformant"
    STOPPED = "stopped"  # not sent: canaryd was stopping (SIGTERM) when its turn came
    INTERNAL = "internal"

    @property
    def retryable(self) -> bool:
        """Transient failures worth another attempt; a 4xx or a malformed 200 will not improve."""
        return self in (
            ErrorKind.CONNECT,
            ErrorKind.TIMEOUT,
            ErrorKind.RATE_LIMITED,
            ErrorKind.HTTP_5XX,
            ErrorKind.TRUNCATED,
        )


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token with its logprob and the top-k alternatives the server ranked."""

    token: str
    logprob: float
    token_id: int | None = None
    bytes: tuple[int, ...] | None = None
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call an answer made: the name and the arguments exactly as the server sent them (a
    JSON text; a provider that sends an object instead has it serialised)."""

    name: str
    arguments: str


@dataclass(slots=True)
class Observation:
    """One canary sent once through one backend."""

    backend: str
    canary_id: str
    suite: str
    started_at: datetime
    request: dict  # the exact request body sent (minus credentials)
    request_hash: str  # the baseline key: the kind's hash of what the canary decides (`Prober.request_hash`)
    latency_s: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    tokens: list[TokenLogprob] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    reasoning_tokens: int | None = None  # usage.completion_tokens_details.reasoning_tokens (hidden reasoning)
    has_logprobs: bool = True  # whether the answer carried per-token logprobs (else it is judged on text)
    system_fingerprint: str | None = None
    response_model: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    error: str | None = None
    error_kind: ErrorKind | None = None
    stack: dict[str, str] = field(default_factory=dict)  # serving-side facts, see stack.py
    attempts: int = 1  # requests sent for this observation (retries included)
    # The answer's tool calls (None: the response had none). The text carries them too (`openai_wire`), so
    # the store keeps them and a baseline compares them like any answer.
    tool_calls: tuple[ToolCall, ...] | None = None
    # The key of ``request`` in the store (`canonical_digest` of it). A prober that prepares a request once
    # for many observations hands its digest in; otherwise it is computed here, once.
    request_ref: str = ""

    def __post_init__(self) -> None:
        if not self.request_ref:
            self.request_ref = canonical_digest(self.request)

    @property
    def ok(self) -> bool:
        return self.error is None


# A logprob is at most 0 (float rounding may leave one a hair above). vLLM clamps -inf at -9999, so a value
# far below that is no logprob an engine computed: it is garbage, and would swamp every delta.
LOGPROB_MAX = 1e-4
LOGPROB_MIN = -1e5


def _show(value: float | int) -> str:
    try:
        return f"{float(value):.6g}"
    except OverflowError:  # a JSON integer too large for a float
        return "-huge" if value < 0 else "huge"


def logprob_problem(value: object) -> str | None:
    """Why ``value`` is no usable logprob (None when it is one): not a number, NaN, ±inf, above 0 beyond
    rounding, or absurdly negative. Parsers reject such an answer, and the judge refuses such a baseline."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"has type {type(value).__name__}"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value > LOGPROB_MAX:
        return f"{_show(value)} > 0"
    if value < LOGPROB_MIN:
        return f"{_show(value)} < {LOGPROB_MIN:g}"
    return None


def tokens_problem(tokens: Iterable[TokenLogprob]) -> str | None:
    """The first token (or top-k alternative) whose logprob is unusable, as ``tokens.i.logprob: why``."""
    tokens = tokens if isinstance(tokens, list | tuple) else list(tokens)
    # The common case first: every value a plain float in range (`logprob_problem` passes exactly those;
    # NaN fails both comparisons). Anything else, an int included, takes the exact path below.
    lo, hi = LOGPROB_MIN, LOGPROB_MAX
    for t in tokens:
        lp = t.logprob
        if type(lp) is not float or not lo <= lp <= hi:
            break
        for _, lp in t.top:
            if type(lp) is not float or not lo <= lp <= hi:
                break
        else:
            continue
        break
    else:
        return None
    for i, t in enumerate(tokens):
        if (why := logprob_problem(t.logprob)) is not None:
            return f"tokens.{i}.logprob: {why}"
        for j, (_, lp) in enumerate(t.top):
            if (why := logprob_problem(lp)) is not None:
                return f"tokens.{i}.top.{j}.logprob: {why}"
    return None


def text_problem(value: str) -> str | None:
    """Why ``value`` cannot be stored or exported as text (None when it can): a lone surrogate (JSON's
    ``"\\ud800"`` escape decodes to one) has no UTF-8 encoding."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"not valid UTF-8 (lone surrogate at index {e.start})"
    return None


def storable(value: str) -> str:
    """``value`` with anything UTF-8 cannot encode written as a backslash escape (``\\ud800``)."""
    if text_problem(value) is None:
        return value
    return value.encode("utf-8", "backslashreplace").decode("utf-8")
