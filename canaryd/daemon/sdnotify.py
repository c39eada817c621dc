"""Dependency-free ``sd_notify(3)``: tell systemd that canaryd is ready, alive, reloading or stopping.

Why not a library: the protocol is one AF_UNIX datagram of newline-separated ``KEY=value`` lines sent to
``$NOTIFY_SOCKET``, and systemd documents it as stable and explicitly endorses reimplementing it (the
``sd_notify(3)`` man page ships an MIT-0 Python example that this module follows). The Python bindings are
either unmaintained (``sdnotify``) or need ``libsystemd-dev`` to build (``systemd-python``).

Every function only reads the environment, so the same daemon runs unchanged in a shell, under a test, or
as a ``Type=notify`` unit: without ``$NOTIFY_SOCKET`` nothing is sent and nothing fails.

How the daemon uses it (``systemd/canaryd.service`` has ``Type=notify`` and ``WatchdogSec=``)::

    notify("READY=1", "STATUS=3 canaries scheduled")  # once DB, HTTP listener and scheduler are up
    notify("WATCHDOG=1")                               # every watchdog_period() seconds, if not None
    reloading("STATUS=reloading config")               # on SIGHUP, before re-reading the config ...
    notify("READY=1", "STATUS=...")                    # ... and always after it, even if it failed
    notify("STOPPING=1")                               # on SIGTERM, before shutting down
"""

from __future__ import annotations

import os
import socket
import time


def notify(*states: str) -> bool:
    """Send ``states`` (e.g. ``"READY=1"``, ``"STATUS=ok"``) as one datagram to ``$NOTIFY_SOCKET``.

    Returns True if the datagram was sent. Returns False, without raising, when ``$NOTIFY_SOCKET`` is unset
    (not running under systemd), names an address type we do not speak (e.g. ``vsock:``), or the send fails:
    ``sd_notify(3)`` recommends ignoring the result, and a status message must never take the daemon down.
    A name starting with ``@`` is an abstract-namespace socket (Linux), addressed with a leading NUL byte.

    Each argument is one assignment. A newline inside one would start a second, unintended assignment
    (think ``STATUS=`` built from a multi-line exception message), so it is flattened to a space.
    """
    address = os.environ.get("NOTIFY_SOCKET", "")
    if not states or not address.startswith(("/", "@")):
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    message = "\n".join(s.replace("\n", " ") for s in states).encode("utf-8")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            # Never block: a listener that stops reading (its queue holds ~10 datagrams) must not freeze
            # the daemon's main loop, and with it signal handling.
            return sock.send(message, socket.MSG_DONTWAIT) == len(message)
    except OSError:
        return False


def reloading(*states: str) -> bool:
    """Send ``RELOADING=1`` with ``MONOTONIC_USEC=<now>`` (plus ``states``); follow it with ``READY=1``.

    systemd 252 (Debian 12) understands ``RELOADING=1`` for ``Type=notify`` (the unit shows "reloading"
    until ``READY=1``) and ignores ``MONOTONIC_USEC``. systemd >= 253 requires ``MONOTONIC_USEC`` (the
    CLOCK_MONOTONIC time at which the reload started, in microseconds) for ``Type=notify-reload``, so sending
    it now lets the unit switch to ``notify-reload`` later without touching the daemon.
    """
    now_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    return notify("RELOADING=1", f"MONOTONIC_USEC={now_usec}", *states)


def watchdog_period() -> float | None:
    """Seconds between ``WATCHDOG=1`` pings, or None when systemd expects none.

    systemd passes ``WatchdogSec=`` as ``$WATCHDOG_USEC`` and kills the service (SIGABRT) if no ping arrives
    within it; ``sd_watchdog_enabled(3)`` recommends pinging every half of that, which this returns.
    ``$WATCHDOG_PID``, when set, names the process the watchdog is meant for: a child that merely inherited
    the environment (e.g. a subprocess) gets None, so only the main process pings. A malformed or
    non-positive value also gives None, as ``sd_watchdog_enabled`` treats it as "no watchdog".
    """
    try:
        usec = int(os.environ.get("WATCHDOG_USEC", ""))
        pid = os.environ.get("WATCHDOG_PID")
        if pid and int(pid) != os.getpid():
            return None
    except ValueError:
        return None
    return usec / 2 / 1e6 if usec > 0 else None
