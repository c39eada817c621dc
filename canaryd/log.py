"""structlog set-up: JSON lines to stderr when not on a terminal (journald, CI), readable on a TTY.

Stdout stays free for command output (tables, ``--json``), so logs never corrupt what a script parses.

Under systemd, stderr is a stream to journald, which files every line at the unit's default priority (info)
unless the line starts with a syslog priority ``<N>`` (``SyslogLevelPrefix=``, on by default). So when
stderr is the journal, each line gets its level's prefix and ``journalctl -p warning`` shows the warnings.
Libraries' stdlib logging (APScheduler's missed runs, for one) becomes the same lines, warnings and worse.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

import structlog

# syslog priorities (RFC 5424), as sd-daemon(3) lists them for SyslogLevelPrefix=.
PRIORITY = {"debug": 7, "info": 6, "warning": 4, "error": 3, "critical": 2}


def stderr_is_journal(stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (default stderr) is the journald stream systemd connected.

    systemd sets ``JOURNAL_STREAM=<device>:<inode>`` of that stream (systemd.exec(5)); a process whose stderr
    was redirected since (a pipe, a file) inherits the variable but not the stream, hence the comparison.
    """
    stream = sys.stderr if stream is None else stream
    dev, _, ino = os.environ.get("JOURNAL_STREAM", "").partition(":")
    try:
        st = os.fstat(stream.fileno())
        return (st.st_dev, st.st_ino) == (int(dev), int(ino))
    except (ValueError, OSError, AttributeError):  # unset or malformed, or a stream without a descriptor
        return False


def journal_prefix(level: str) -> str:
    """``<N>`` for a level name (``<6>``, info, for anything unknown)."""
    return f"<{PRIORITY.get(level, 6)}>"


def to_stderr(line: str, level: str) -> None:
    """A message for the user (``canaryd: error: …``) on stderr, with its priority when that is the journal:
    the one line that says why a unit failed is what ``journalctl -p err`` must show."""
    prefix = journal_prefix(level) if stderr_is_journal() else ""
    print(prefix + line, file=sys.stderr)


def configure(level: str = "info", *, json: bool | None = None) -> None:
    if json is None:
        json = not sys.stderr.isatty()
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    if stderr_is_journal():
        renderer = _prefixed(renderer)
    threshold = logging.getLevelNamesMapping()[level.upper()]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            _TIMESTAMP,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(threshold),
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=False,
    )
    _route_stdlib(renderer, max(threshold, logging.WARNING))


_TIMESTAMP = structlog.processors.TimeStamper(fmt="iso", utc=True)


def _stderr_logger(*_args: object) -> structlog.PrintLogger:
    """A logger on whatever ``sys.stderr`` is when a line is logged, not when logging was set up (a
    redirected stderr, as a test runner's, may be closed since)."""
    return structlog.PrintLogger(sys.stderr)


class _StderrHandler(logging.StreamHandler):
    """`logging.StreamHandler` on the current ``sys.stderr`` (see `_stderr_logger`)."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value: object) -> None:
        pass


_stdlib_handler: logging.Handler | None = None


def _route_stdlib(renderer: structlog.types.Processor, threshold: int) -> None:
    """Render stdlib records at ``threshold`` or worse like structlog's, with their logger's name.

    Without it Python's last-resort handler prints their bare message: no JSON, no priority. Only the
    handler added here is replaced on a second call; others' handlers (pytest's) stay.
    """
    global _stdlib_handler
    handler = _StderrHandler()
    handler.setLevel(threshold)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[
                structlog.stdlib.add_logger_name,
                structlog.processors.add_log_level,
                _TIMESTAMP,
                structlog.processors.format_exc_info,
            ],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    if _stdlib_handler is not None:
        root.removeHandler(_stdlib_handler)
    root.addHandler(handler)
    _stdlib_handler = handler


def _prefixed(renderer: structlog.types.Processor) -> structlog.types.Processor:
    """``renderer``'s line behind the journald priority of its level (``add_log_level`` set it)."""

    def render(logger: object, method: str, event: dict) -> str:
        return journal_prefix(event.get("level", "")) + renderer(logger, method, event)

    return render
