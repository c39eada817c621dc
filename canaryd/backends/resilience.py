"""The resilience every backend kind shares: retry policy, circuit breaker, and `Resilient`, which wraps a
kind with both.

A canary must see failures, so retries are few and visible (each observation records its attempts), and
a backend that keeps failing is left alone for a cool-down instead of being hammered every cycle. The
policy and the breaker are pure logic with an injectable clock.

Retries never outlast a stop: `Resilient` takes a ``stopping`` event (the daemon's, set on SIGTERM). Once
it is set no attempt starts (a canary whose turn had not come is recorded as ``stopped``, unsent), a
backoff wait wakes up at once, and what was in flight ends at its own deadline (``timeout_s``), so a stop
waits for one attempt at most, however many retries were configured.

A daemon bounds its requests in flight across all its backends (``[daemon] max_in_flight``): ``gate`` is
held around each attempt and each snapshot, and an attempt that waited for it while a stop came is not
sent.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

from canaryd.backends.base import BackendUnavailable
from canaryd.observation import ErrorKind, Observation, utcnow
from canaryd.stack import stamped

if TYPE_CHECKING:
    from canaryd.backends.base import BackendSettings, Prober
    from canaryd.canaries import Canary


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    retries: int = 2  # extra attempts after the first
    backoff_s: float = 0.5  # first wait; doubles each retry, plus up to the same again as jitter
    max_wait_s: float = 30.0  # cap on any wait, Retry-After included

    def wait_s(
        self, attempt: int, retry_after: float | None = None, rand: Callable[[], float] = random.random
    ) -> float:
        """Seconds to wait before retry number ``attempt`` (1-based); the server's Retry-After wins."""
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.max_wait_s)
        base = self.backoff_s * 2 ** (attempt - 1)
        return min(base + base * rand(), self.max_wait_s)


@dataclass
class CircuitBreaker:
    """closed → (``failures`` in a row) → open → (``cooldown_s``) → half-open: one trial → closed or open."""

    failures: int = 5
    cooldown_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    _consecutive: int = 0
    _opened_at: float | None = None
    _trial_out: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def state(self) -> str:
        if self._opened_at is None:
            return "closed"
        return "half-open" if self.clock() - self._opened_at >= self.cooldown_s else "open"

    def allow(self) -> bool:
        """May a request go out now? In half-open state exactly one trial is let through."""
        with self._lock:
            state = self.state
            if state == "closed":
                return True
            if state == "half-open" and not self._trial_out:
                self._trial_out = True
                return True
            return False

    def record(self, success: bool) -> None:
        with self._lock:
            self._trial_out = False
            if success:
                self._consecutive, self._opened_at = 0, None
                return
            self._consecutive += 1
            if self._opened_at is not None or self._consecutive >= self.failures:
                self._opened_at = self.clock()


class Resilient:
    """Any kind, with the retry policy and circuit breaker every kind shares (the `Backend` canaryd uses).

    Like blackbox_exporter's handler around a prober: the kind sends one request per `attempt`; this owns
    the attempts, the waits between them, the breaker and the bookkeeping. Only transport-level failures
    (``ErrorKind.retryable``) are retried or trip the breaker: a malformed answer is the backend's answer.
    An exception a kind lets escape becomes an ``internal`` observation, never a lost pass.
    """

    def __init__(
        self,
        prober: Prober,
        settings: BackendSettings,
        stopping: threading.Event | None = None,
        gate: AbstractContextManager | None = None,
    ) -> None:
        self.prober = prober
        self.gate = gate if gate is not None else nullcontext()
        self.name, self.kind = prober.name, prober.kind
        self.retry = RetryPolicy(settings.retries, settings.retry_backoff, settings.retry_max_wait)
        self.breaker = CircuitBreaker(settings.breaker_failures, settings.breaker_cooldown)
        self.stopping = stopping if stopping is not None else threading.Event()
        if hasattr(prober, "stopping"):  # a kind whose snapshot makes several calls stops between them
            prober.stopping = self.stopping  # type: ignore[attr-defined]

    @property
    def concurrency(self) -> int:
        return self.prober.concurrency

    def snapshot(self) -> dict[str, str]:
        """The kind's snapshot, stamped with the version of canaryd's recording rules (`stack.stamped`)."""
        if self.stopping.is_set():
            raise BackendUnavailable(ErrorKind.STOPPED, "not probed: canaryd is stopping")
        with self.gate:
            return stamped(self.prober.snapshot())

    def request(self, canary: Canary) -> dict:
        return self.prober.request(canary)

    def request_hash(self, canary: Canary) -> str:
        return self.prober.request_hash(canary)

    def attempt(self, canary: Canary) -> Observation:
        return self.prober.attempt(canary)

    def close(self) -> None:
        self.prober.close()

    def probe(self, canary: Canary) -> Observation:
        """Send one canary, retrying transient failures; never raises."""
        started = utcnow()
        if self.stopping.is_set():
            return self._stopped(canary, started)
        if not self.breaker.allow():
            obs = self._unsent(canary, started)
            obs.error_kind, obs.attempts = ErrorKind.CIRCUIT_OPEN, 0
            obs.error = f"not sent: {self.breaker.failures}+ failed probes in a row, cooling down"
            return obs
        attempt, stopped = 1, False
        while True:
            with self.gate:
                if self.stopping.is_set():  # it came while this attempt waited for the gate
                    if attempt == 1:
                        return self._stopped(canary, started)
                    attempt, stopped = attempt - 1, True
                    break
                obs = self._attempt(canary, started)
            obs.attempts = attempt
            if (
                obs.ok
                or obs.error_kind is None
                or not obs.error_kind.retryable
                or attempt > self.retry.retries
            ):
                break
            wait = self.retry.wait_s(attempt, _seconds(obs.headers.get("retry-after")))
            if self.stopping.wait(wait):  # wakes at once on a stop: no further attempt
                stopped = True
                break
            attempt += 1
        if attempt > 1 and obs.error:
            obs.error = f"{obs.error} (after {attempt} attempts)"
        if stopped and obs.error:
            obs.error = f"{obs.error} (not retried: canaryd is stopping)"
        self.breaker.record(obs.ok or not obs.error_kind.retryable)  # type: ignore[union-attr]
        return obs

    def _attempt(self, canary: Canary, started: datetime) -> Observation:
        try:
            obs = self.prober.attempt(canary)
        except Exception as e:  # a kind's bug must cost one observation, not the pass
            obs = self._unsent(canary, started)
            obs.error_kind, obs.error = ErrorKind.INTERNAL, f"{e.__class__.__name__}: {str(e)[:300]}"
        obs.started_at = started
        return obs

    def _stopped(self, canary: Canary, started: datetime) -> Observation:
        obs = self._unsent(canary, started)
        obs.error_kind, obs.attempts = ErrorKind.STOPPED, 0
        obs.error = "not sent: canaryd is stopping"
        return obs

    def _unsent(self, canary: Canary, started: datetime) -> Observation:
        try:
            body, rhash = self.prober.request(canary), self.prober.request_hash(canary)
        except Exception:
            body, rhash = {}, ""
        return Observation(self.name, canary.id, canary.suite, started, body, rhash)


def _seconds(value: str | None) -> float | None:
    """A Retry-After header in seconds (the HTTP-date form is rare for APIs and treated as absent)."""
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is None or math.isfinite(seconds) else None
