"""Imports paid for only when used, so that ``canaryd --help`` and ``canaryd validate`` start fast.

Every backend kind module is imported to validate a config (its ``Settings`` are in the config's union),
but only a probe needs its HTTP client or logs: such modules import those names through here. The rest
of canaryd imports heavy packages inside the functions that use them. The CLI also spares pydantic's
search for plugins (`skip_pydantic_plugins`).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

_before_first_log: Callable[[], None] | None = None
_PLUGINS = "PYDANTIC_DISABLE_PLUGINS"
_plugins_skipped = False


def skip_pydantic_plugins() -> None:
    """Tell pydantic not to look for plugins (its own switch): canaryd uses none, and the look reads the
    entry points of every installed distribution when the first model is built, 20-50 ms of each command's
    start here. A value the user set is kept (``PYDANTIC_DISABLE_PLUGINS=`` brings plugins back), and what
    canaryd starts for the user runs in the environment the user gave (`user_environ`)."""
    global _plugins_skipped
    if _PLUGINS not in os.environ:
        os.environ[_PLUGINS] = "__all__"
        _plugins_skipped = True


def user_environ() -> dict[str, str]:
    """This process's environment as the user gave it: for the commands canaryd starts."""
    env = dict(os.environ)
    if _plugins_skipped:
        env.pop(_PLUGINS, None)
    return env


def lazy_import(name: str) -> ModuleType:
    """The module ``name``, executed on its first attribute access (`importlib.util.LazyLoader`)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ImportError(f"no module named {name!r}", name=name)
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)
    return module


def on_first_log(configure: Callable[[], None]) -> None:
    """Run ``configure`` (the CLI's logging set-up) before a `Logger` logs for the first time (or at
    `set_up_logging`); a later call replaces a set-up still pending."""
    global _before_first_log
    _before_first_log = configure


def set_up_logging() -> None:
    """Run the pending set-up now (for commands whose modules log through structlog directly)."""
    global _before_first_log
    configure, _before_first_log = _before_first_log, None
    if configure is not None:
        configure()


class Logger:
    """A structlog logger that imports structlog (about 0.1 s with rich) when it first logs."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        set_up_logging()
        import structlog

        return getattr(structlog.get_logger(self._name), attr)
