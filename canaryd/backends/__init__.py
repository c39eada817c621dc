"""Backend kinds: one module each, registered in `KINDS`, the only place that lists them.

A kind module defines ``Settings`` (its ``[[backends]]`` block: a `base.BackendSettings` subclass with
``kind: Literal["<name>"]``) and ``Prober`` (the `base.Prober` built from those settings), and may define
``EXAMPLE`` (a commented config block `canaryd init` writes) and ``ENGINE_VERSION_FIELD`` (the stack field
the metrics show as the engine version; its family, ``<family>.version``, ranks among the engine builds in
`explain`'s revert order, `revert_first`). The config file validates ``backends`` against the union of the
registered ``Settings``; `make_backend` wraps every ``Prober`` in the same resilience.

Adding a kind is one module and one line here; the ``scripted`` kind (a fake for tests and alert drills)
was added exactly that way.
"""

from __future__ import annotations

import importlib
import threading
from contextlib import AbstractContextManager
from functools import cache
from types import ModuleType
from typing import Any

from canaryd.backends.base import Backend, BackendSettings, BackendUnavailable, HttpSettings, Prober

__all__ = [
    "KINDS",
    "REVERT_LAST",
    "Backend",
    "BackendSettings",
    "BackendUnavailable",
    "HttpSettings",
    "Prober",
    "declared",
    "engine_version",
    "examples",
    "make_backend",
    "revert_first",
    "settings_of",
    "settings_types",
]

KINDS: dict[str, str] = {
    "vllm": "canaryd.backends.vllm_server",
    "openai": "canaryd.backends.openai_compat",
    "openai-responses": "canaryd.backends.openai_responses",
    "vllm-offline": "canaryd.backends.vllm_offline",
    "llamacpp": "canaryd.backends.llamacpp",
    "scripted": "canaryd.backends.scripted",
    "sglang": "canaryd.backends.sglang",
    "tgi": "canaryd.backends.tgi",
    "ollama": "canaryd.backends.ollama",
    "litellm": "canaryd.backends.litellm",
}

# Stack field families (the first dotted part, ``host.`` skipped) in the order `explain` suggests
# reverting them: causes before consequences. Settings cheapest to put back first (``engine.*``: every
# kind's launch arguments, under one family, whatever the engine), then environment and cache config, then
# engine builds (each kind's own family, `revert_first`), weights (``model.*``), tokenizer and hardware;
# what a server or a gateway reports about itself comes last.
_SETTINGS = ("engine", "env", "metrics")
_BUILDS = ("packages", "torch", "python", "models", "model")
REVERT_LAST = ("template", "gpu", "cpu", "os", "request", "backend", "gateway", "header", "response")


@cache
def _module(kind: str) -> ModuleType:
    return importlib.import_module(KINDS[kind])


def settings_of(kind: str) -> type[BackendSettings]:
    """A registered kind's config block (its module is imported on first use)."""
    return _module(kind).Settings


def settings_types() -> tuple[type[BackendSettings], ...]:
    """Every registered kind's config block, in registry order."""
    return tuple(map(settings_of, KINDS))


def make_backend(
    settings: BackendSettings,
    stopping: threading.Event | None = None,
    gate: AbstractContextManager | None = None,
) -> Backend:
    """The kind's prober, wrapped in the shared retries and circuit breaker; once ``stopping`` is set (the
    daemon's stop) no new attempt starts and a backoff wait ends; ``gate`` (the daemon's in-flight cap) is
    held around each request."""
    from canaryd.backends.resilience import Resilient

    return Resilient(_module(settings.kind).Prober(settings), settings, stopping, gate)


def declared(kind: str, name: str, default: Any = None) -> Any:
    """What a registered kind's module declares under ``name`` (``default`` where it declares nothing)."""
    return getattr(_module(kind), name, default)


def examples() -> list[str]:
    """The commented config blocks the kinds offer, in registry order (the first one active)."""
    return [m.EXAMPLE for m in map(_module, KINDS) if hasattr(m, "EXAMPLE")]


def engine_version(kind: str, stack: dict[str, str]) -> str:
    """The engine version a stack names, by the kind's own field ("" when the kind has none)."""
    field = getattr(_module(kind), "ENGINE_VERSION_FIELD", None) if kind in KINDS else None
    return stack.get(field, "") if field else ""


def revert_first() -> tuple[str, ...]:
    """The families `explain` suggests reverting first, in order: the settings, each kind's own family (the
    head of its ``ENGINE_VERSION_FIELD``, in registry order), the builds and the weights. A kind registered
    with a version field has its fields ranked, with nothing else to list."""
    ranked = {*_SETTINGS, *_BUILDS, *REVERT_LAST}
    kinds = (getattr(_module(k), "ENGINE_VERSION_FIELD", "").partition(".")[0] for k in KINDS)
    return (*_SETTINGS, *dict.fromkeys(f for f in kinds if f and f not in ranked), *_BUILDS)
