"""The daemon's signals, caught from the first moment of `canaryd run`.

Python's default SIGTERM handler kills the process where it stands: during start-up (imports, the store's
migration, loading suites, building backends) that is no clean stop. `install` is the first thing
``python -m canaryd run`` does (before the heavy imports) and the first thing the ``run`` command does:
from then on SIGTERM and SIGINT only set the stop event and SIGHUP the reload event; the daemon takes the
events over (`install` again, with its own) and acts on a signal that came early as soon as it can.

Deliberately light: only the standard library (and `canaryd.argv`, as light), so that installing it costs
nothing.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Sequence

from canaryd.argv import command_of

_stop = threading.Event()
_reload = threading.Event()


def install(
    stop: threading.Event | None = None, reload: threading.Event | None = None
) -> tuple[threading.Event, threading.Event]:
    """Route SIGTERM/SIGINT to ``stop`` and SIGHUP to ``reload`` (default: the events already routed to);
    a signal that arrived before is carried over to the new events. Main thread only."""
    global _stop, _reload
    if stop is not None:
        old, _stop = _stop, stop  # swap first: a signal from here on sets the new event
        if old.is_set():
            stop.set()
    if reload is not None:
        old, _reload = _reload, reload
        if old.is_set():
            reload.set()
    signal.signal(signal.SIGTERM, _on_stop)
    signal.signal(signal.SIGINT, _on_stop)
    signal.signal(signal.SIGHUP, _on_reload)
    return _stop, _reload


def _on_stop(_signum: int, _frame: object) -> None:
    _stop.set()


def _on_reload(_signum: int, _frame: object) -> None:
    _reload.set()


def runs_daemon(argv: Sequence[str]) -> bool:
    """Whether a command line (without the program name) is ``canaryd [options] run``."""
    return command_of(argv) == "run"
