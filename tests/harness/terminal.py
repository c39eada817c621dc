"""Run a command under a pseudo-terminal of a given size, as a person at a terminal would see it.

Stdin, stdout and stderr are all the terminal (so ``isatty()`` is true for each, and rich and the progress
line see a real window size); what the terminal receives comes back with the time of each chunk, so that
a test or a bench can say when the first progress line appeared.
"""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import termios
import time
from dataclasses import dataclass


@dataclass
class Screen:
    returncode: int
    chunks: list[tuple[float, bytes]]  # (seconds since start, bytes) as the terminal received them

    @property
    def text(self) -> str:
        return b"".join(c for _, c in self.chunks).decode("utf-8", "replace")

    def first(self, needle: str) -> float | None:
        """Seconds from start until ``needle`` had been received, None if never."""
        seen = b""
        for t, c in self.chunks:
            seen += c
            if needle.encode() in seen:
                return t
        return None


def run_in_terminal(
    argv: list[str], *, columns: int = 100, rows: int = 40, env: dict | None = None, timeout: float = 120
) -> Screen:
    main, sub = pty.openpty()
    fcntl.ioctl(sub, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    env = {k: v for k, v in (env or os.environ).items() if k not in ("COLUMNS", "LINES")}
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdin=sub, stdout=sub, stderr=sub, env=env, close_fds=True)
    os.close(sub)
    chunks: list[tuple[float, bytes]] = []
    try:
        while True:
            if time.monotonic() - t0 > timeout:
                proc.kill()
                raise TimeoutError(f"{argv} ran past {timeout} s")
            ready, _, _ = select.select([main], [], [], 0.05)
            if ready:
                try:
                    data = os.read(main, 65536)
                except OSError:  # EIO: the terminal's last writer is gone
                    data = b""
                if not data:
                    break
                chunks.append((time.monotonic() - t0, data))
            elif proc.poll() is not None and not select.select([main], [], [], 0)[0]:
                break
    finally:
        os.close(main)
    return Screen(proc.wait(timeout=timeout), chunks)
