"""Backends: one small protocol any engine can implement (cf. blackbox_exporter's prober interface).

A backend knows how to send one canary and how to describe the serving stack behind it. It never
raises from `probe`: a failure is an observation too, with an `ErrorKind`.
"""

from __future__ import annotations

from typing import Protocol

from canaryd.canaries import Canary
from canaryd.config import BackendConfig
from canaryd.observation import ErrorKind, Observation


class BackendUnavailable(Exception):
    """The backend could not be reached while taking its stack snapshot."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Backend(Protocol):
    name: str
    kind: str
    concurrency: int

    def snapshot(self) -> dict[str, str]:
        """Serving-side facts, flat and stable (no timestamps). Raises `BackendUnavailable`."""
        ...

    def probe(self, canary: Canary) -> Observation:
        """Send one canary; always returns an observation (with ``error`` set on failure)."""
        ...

    def request_hash(self, canary: Canary) -> str:
        """The hash ``probe`` gives this canary's request (what baselines are keyed by), without sending."""
        ...

    def close(self) -> None: ...


def make_backend(cfg: BackendConfig) -> Backend:
    if cfg.kind == "vllm-offline":  # imports vLLM only when the engine starts, not here
        from canaryd.backends.vllm_offline import VLLMOfflineBackend

        return VLLMOfflineBackend(cfg)
    from canaryd.backends.openai_compat import OpenAICompatBackend
    from canaryd.backends.vllm_server import VLLMServerBackend

    kinds: dict[str, type[OpenAICompatBackend]] = {"openai": OpenAICompatBackend, "vllm": VLLMServerBackend}
    return kinds[cfg.kind](cfg)
