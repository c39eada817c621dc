"""Progress of a long command as one updating line on stderr ("probing 3/13 canaries on local-vllm").

Shown only while a command runs on a terminal: the CLI turns it on (`shown`) unless stderr is piped or
``--json`` was asked for, and everywhere else (the daemon, tests, scripts) every call here is a no-op.
The work reports through `step` from any thread; the line is redrawn at most every 0.1 s so that a fast
pass costs nothing. Plain writes, no rich: the line must appear before the first probe returns.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TextIO, TypeVar

_REDRAW_S = 0.1
T, R = TypeVar("T"), TypeVar("R")


class Line:
    """One updating line: ``{verb} {done}/{total} {noun} on {target}``."""

    def __init__(self, stream: TextIO, verb: str, noun: str) -> None:
        self.stream, self.verb, self.noun = stream, verb, noun
        self.done = self.total = 0
        self.target = ""
        self._lock = threading.Lock()
        self._drawn = 0.0
        self._width = 0

    def announce(self) -> None:
        """``{verb} …`` at once, before the command's imports and set-up (then `begin` counts)."""
        with self._lock:
            self._write(f"{self.verb} …")

    def begin(self, total: int, target: str = "") -> None:
        """Start counting ``total`` units of work (on ``target``: a backend's name) and draw at once."""
        with self._lock:
            self.done, self.total, self.target = 0, total, target
            self._draw()

    def step(self, n: int = 1) -> None:
        with self._lock:
            self.done += n
            if self.done >= self.total or time.monotonic() - self._drawn >= _REDRAW_S:
                self._draw()

    def _draw(self) -> None:
        on = f" on {self.target}" if self.target else ""
        self._write(f"{self.verb} {self.done}/{self.total} {self.noun}{on}")

    def _write(self, text: str) -> None:
        self.stream.write("\r" + text.ljust(self._width))
        self.stream.flush()
        self._width, self._drawn = len(text), time.monotonic()

    def clear(self) -> None:
        with self._lock:
            if self._width:
                self.stream.write("\r" + " " * self._width + "\r")
                self.stream.flush()
            self._width = 0


_current: Line | None = None


def begin(total: int, target: str = "") -> None:
    """A new stage of the current command's work (no-op unless the CLI shows progress)."""
    if _current is not None:
        _current.begin(total, target)


def step(n: int = 1) -> None:
    """``n`` more units done (thread-safe; no-op unless the CLI shows progress, or in a `quiet` block)."""
    if _current is not None and not getattr(_quiet, "on", False):
        _current.step(n)


_quiet = threading.local()


@contextmanager
def quiet() -> Iterator[None]:
    """Work in this thread that is no unit of the current stage (a pass's learning probes) counts none."""
    _quiet.on = True
    try:
        yield
    finally:
        _quiet.on = False


@contextmanager
def shown(verb: str, noun: str, *, enabled: bool = True, stream: TextIO | None = None) -> Iterator[None]:
    """Show progress on ``stream`` (stderr) while the block runs, if enabled and the stream is a terminal;
    the line is erased at the end, so that tables and errors start on a clean line."""
    global _current
    stream = stream or sys.stderr
    if not enabled or not stream.isatty():
        yield
        return
    line = _current = Line(stream, verb, noun)
    line.announce()
    try:
        yield
    finally:
        _current = None
        line.clear()


def counted(fn: Callable[[T], R]) -> Callable[[T], R]:
    """``fn`` that counts a `step` each time it returns or raises (for ``executor.map``, `workers.pulled`)."""

    def wrapper(arg: T) -> R:
        try:
            return fn(arg)
        finally:
            step()

    return wrapper


def each(items: Iterable[T]) -> Iterator[T]:
    """``items``, counting a `step` as each one's work ends (when the next is asked for)."""
    for item in items:
        yield item
        step()
