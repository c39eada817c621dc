"""Retry policy and circuit breaker for one backend: pure logic with an injectable clock.

A canary must see failures, so retries are few and visible (each observation records its attempts), and
a backend that keeps failing is left alone for a cool-down instead of being hammered every cycle.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


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
