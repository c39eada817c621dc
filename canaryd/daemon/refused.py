"""A backend that does not re-send a request it refused as configured.

A request refused for an unsupported parameter or value (`ErrorKind.CONFIG`, `canaryd.backends.refusals`)
will be refused every cycle, and some providers bill refused requests: the daemon sends each refused canary
once, then records it as ``not sent`` (with the refusal) until the config is reloaded or the process
restarts. The refusals are kept per canary, not per backend: a backend that refuses one canary's parameter
(a sampled canary's temperature, a raw prompt's /completions endpoint) may take the others as they are.
The wrapper lives as long as its `Generation`, so a reload (SIGHUP) starts with none.
"""

from __future__ import annotations

import threading
from typing import Any

import structlog

from canaryd.backends import Backend
from canaryd.canaries import Canary
from canaryd.observation import ErrorKind, Observation, utcnow

log = structlog.get_logger("canaryd.daemon")


class Guarded:
    """``backend`` with `probe` held back for canaries it refused as configured; the rest passes through."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.refused: dict[str, str] = {}  # canary id -> the refusal's one line
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    def probe(self, canary: Canary) -> Observation:
        why = self.refused.get(canary.id)
        if why is None:
            obs = self.backend.probe(canary)
            if obs.error_kind is ErrorKind.CONFIG and obs.error:
                self._refuse(canary, obs.error)
            return obs
        b = self.backend
        obs = Observation(
            b.name, canary.id, canary.suite, utcnow(), b.request(canary), b.request_hash(canary)
        )
        obs.error_kind, obs.attempts = ErrorKind.CONFIG, 0
        obs.error = f"not sent until the config is reloaded: {why}"
        return obs

    def _refuse(self, canary: Canary, why: str) -> None:
        with self._lock:
            first = why not in self.refused.values()  # logged once per distinct refusal
            self.refused[canary.id] = why
        if first:
            log.error(
                "config_refused", backend=self.backend.name, canary=canary.id, error=why, resend="on reload"
            )
