"""What one probe saw: the typed record that flows from a backend to the store and the comparator.

Everything here is plain data. Backends build it, `canaryd.store` persists it, `canaryd.judge` reads it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import UTC, datetime


def utcnow() -> datetime:
    """Aware UTC now: every timestamp canaryd records (observations, runs, baselines) comes from here."""
    return datetime.now(UTC)


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
    NO_LOGPROBS = "no_logprobs"
    CIRCUIT_OPEN = "circuit_open"  # not sent: the backend failed repeatedly and is cooling down
    TOO_LARGE = "too_large"  # the answer passed a cap: body bytes, or more tokens than max_tokens asked
    CHECK_TIMEOUT = "check_timeout"  # the expected-answer check ran out of time (a backtracking regex)
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


@dataclass(slots=True)
class Observation:
    """One canary sent once through one backend."""

    backend: str
    canary_id: str
    suite: str
    started_at: datetime
    request: dict  # the exact request body sent (minus credentials)
    request_hash: str
    latency_s: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    tokens: list[TokenLogprob] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    system_fingerprint: str | None = None
    response_model: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    error: str | None = None
    error_kind: ErrorKind | None = None
    stack: dict[str, str] = field(default_factory=dict)  # serving-side facts, see stack.py
    attempts: int = 1  # requests sent for this observation (retries included)

    @property
    def ok(self) -> bool:
        return self.error is None
