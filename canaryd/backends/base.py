"""What every backend kind shares: the config fields each block has, the one signature a kind implements,
and the `Backend` the rest of canaryd sees (a kind wrapped in the shared resilience, `resilience.py`).

A kind (cf. blackbox_exporter's prober) sends one request per `attempt` and describes its serving stack;
it never retries, never counts attempts and never trips a breaker: the wrapper owns all of that, the same
way for every kind. `attempt` never raises: a failure is an observation too, with an `ErrorKind`.
"""

from __future__ import annotations

import contextvars
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Protocol

from pydantic import Field, field_validator, model_validator

from canaryd.backends.profile import RequestProfile, check_preset, effective
from canaryd.canaries import ID_PATTERN, Canary
from canaryd.errors import InputError
from canaryd.fields import ENV_NAME, Duration, Strict
from canaryd.files import exposed, read_regular
from canaryd.lazy import Logger
from canaryd.observation import ErrorKind, Observation

log = Logger("canaryd.backends")  # structlog, imported when it first logs
KEY_FILE_BYTES = 64 << 10  # an API key file is small; a larger one (or a device, a FIFO) is refused
# How many requests the sender released at once, this one included (1: alone): `canaryd.probe.batching`
# sets it for a crowded round. A real engine sees its batch for itself; a simulating kind (the scripted
# kind's noise model) reads it to pick the numerical path the batch would take.
CROWD: contextvars.ContextVar[int] = contextvars.ContextVar("canaryd_crowd", default=1)


class BackendUnavailable(Exception):
    """The backend could not be reached while taking its stack snapshot."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class BackendSettings(Strict):
    """The fields every ``[[backends]]`` block has; a kind subclasses it with ``kind: Literal[...]``."""

    name: Annotated[str, Field(pattern=ID_PATTERN)]
    kind: str
    model: str  # the served model name (or what the kind's engine loads)
    # The whole request (connect, send, every read) must finish within this, however the server drips.
    timeout_s: Annotated[float, Field(gt=0, le=3600)] = 60.0
    # A response body larger than this is not read further (``too_large``); a canary answer is short.
    max_response_bytes: Annotated[int, Field(ge=1024, le=1 << 30)] = 8 << 20
    concurrency: Annotated[int, Field(ge=1, le=256)] = 4
    # Transient failures (connect, timeout, 429, 5xx, cut body) are retried this often, with exponential
    # backoff and jitter (Retry-After honoured, capped); after breaker_failures failed probes in a row the
    # backend is left alone for breaker_cooldown.
    retries: Annotated[int, Field(ge=0, le=10)] = 2
    retry_backoff: Duration = 0.5
    retry_max_wait: Duration = 30.0
    breaker_failures: Annotated[int, Field(ge=1, le=1000)] = 5
    breaker_cooldown: Duration = 60.0
    # What the backend may be sent per UTC day (counted from the store, so a restart does not reset it):
    # the daemon skips a pass that would go past either, and ``check`` refuses (exit 3). None: no limit.
    budget_tokens_per_day: Annotated[int, Field(ge=1)] | None = None
    budget_requests_per_day: Annotated[int, Field(ge=1)] | None = None
    # Another backend serving the weights this one claims (typically a local vLLM): it re-scores this
    # backend's answers by teacher forcing (`canaryd.probe.reference`). It must be able to score.
    reference: Annotated[str | None, Field(pattern=ID_PATTERN)] = None

    @property
    def scores(self) -> bool:
        """Whether the kind can teacher-force a given continuation (`Scorer`); a kind that can says so."""
        return False


class HttpSettings(BackendSettings):
    """A kind reached over HTTP: where, the name of the secret that opens it (never the secret), and what
    its requests carry beyond the canary (a ``preset`` and a ``[backends.request]`` table, `profile.py`)."""

    base_url: str
    api_key_env: Annotated[str | None, Field(pattern=ENV_NAME)] = None
    api_key_file: Path | None = None
    connect_timeout_s: Annotated[float, Field(gt=0, le=600)] = 5.0
    preset: str | None = None
    request: RequestProfile = RequestProfile()

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, v: str | None) -> str | None:
        return check_preset(v)

    @property
    def profile(self) -> RequestProfile:
        """The effective request profile: the preset, with the explicit keys overriding it."""
        return effective(self.preset, self.request)

    @property
    def no_completions(self) -> str | None:
        """Why raw-prompt canaries cannot go to this backend (the key that says so), None when they can."""
        if self.profile.completions:
            return None
        if "completions" in self.request.model_fields_set:
            return "request.completions = false"
        return f"preset = {self.preset!r}"

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not re.match(r"^https?://[^\s/]+", v):
            raise ValueError("must be an http:// or https:// URL")
        return v.rstrip("/")

    @model_validator(mode="after")
    def _one_key_source(self) -> HttpSettings:
        if self.api_key_env and self.api_key_file:
            raise ValueError("give at most one of api_key_env, api_key_file")
        return self

    def api_key(self) -> str | None:
        """Read the key at the last moment; it is handed to the HTTP client and nowhere else."""
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise InputError(f"backend {self.name!r}: environment variable {self.api_key_env} is not set")
            return key
        if self.api_key_file:
            path = self.api_key_file
            if not path.is_absolute() and os.environ.get("CREDENTIALS_DIRECTORY"):
                path = Path(os.environ["CREDENTIALS_DIRECTORY"]) / path
            problem = exposed(path)
            if problem is not None:  # still used: a warning, so that a working setup keeps working
                log.warning("api_key_file_exposed", backend=self.name, path=str(path), problem=problem)
            try:
                return read_regular(path, "api_key_file", limit=KEY_FILE_BYTES).strip()
            except (OSError, UnicodeDecodeError) as e:
                why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
                raise InputError(f"backend {self.name!r}: cannot read api_key_file {path}: {why}") from None
            except InputError as e:
                raise InputError(f"backend {self.name!r}: {e}") from None
        return None


class Prober(Protocol):
    """The one signature a kind implements (its module registers it in `canaryd.backends.KINDS`)."""

    name: str
    kind: str
    concurrency: int  # canaries in flight at once (a kind that serialises its probes says 1)

    def snapshot(self) -> dict[str, str]:
        """Serving-side facts, flat and stable (no timestamps). Raises `BackendUnavailable`."""
        ...

    def request(self, canary: Canary) -> dict:
        """The exact request body `attempt` sends for this canary (minus credentials)."""
        ...

    def request_hash(self, canary: Canary) -> str:
        """What baselines are keyed by: the hash of what the canary decides, without sending."""
        ...

    def attempt(self, canary: Canary) -> Observation:
        """Send the canary once; always returns an observation (with ``error`` set on failure)."""
        ...

    def close(self) -> None: ...


class Scorer(Protocol):
    """A kind that can score a given continuation (teacher forcing) instead of sampling one: its `attempt`
    on a canary with ``continuation`` set returns an observation whose tokens are the continuation's, each
    with its logprob and top-k as the model ranks them at that position. Its settings' ``scores`` is True.

    Scoring is an attempt like any other, so the shared resilience retries it and `probe.vet` checks it;
    a response that cannot be read is an error observation, never a pass."""

    def attempt(self, canary: Canary) -> Observation: ...


def cannot_score(config: Any, suites: Iterable[Any], only: str | None = None) -> str | None:
    """The first forced canary (``continuation``) a config binds to a backend whose kind cannot score, as
    a one-line error naming backend and canary; None when there is none. Suites follow their refs' optional
    ``backends`` list, as the probe plan does."""
    for backend in config.backends:
        if backend.scores or only not in (None, backend.name):
            continue
        for ref, suite in zip(config.suites, suites, strict=True):
            if ref.backends is not None and backend.name not in ref.backends:
                continue
            for canary in suite.canaries:
                if canary.continuation is not None:
                    return (
                        f"{config.path}: canary {canary.id!r} (suite {suite.name!r}) is forced "
                        f"(continuation), but backend {backend.name!r} (kind {backend.kind}) cannot score a "
                        "given continuation: leave the backend out of the suite's backends"
                    )
    return None


class Backend(Prober, Protocol):
    """A kind as the rest of canaryd uses it: `probe` adds retries, backoff and the circuit breaker."""

    def probe(self, canary: Canary) -> Observation:
        """Send one canary with the shared resilience; never raises."""
        ...
