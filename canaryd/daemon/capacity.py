"""What one daemon carries: the in-flight cap on its requests, and the passes that overran their interval.

The cap (``[daemon] max_in_flight``) is a `Gate` every backend of the daemon shares: each request attempt
(and each snapshot) holds it while it is out, so a thousand backends with ``concurrency = 4`` each never
put four thousand requests in flight at once, whatever each backend's own limit allows. The passes'
backends run on a pool of the same size: no thread per backend.

A pass that takes longer than its schedule's interval overran: the next one is skipped or late. It is
counted (``canaryd_schedule_overruns_total``) and logged with the backends that made it late, those still
probing when the interval was up (`late_backends`): the slowest of them is where to look, and a daemon
whose passes keep overrunning carries too much (docs/fleets.md: when to add a daemon).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

# A pass's warning names at most this many of its late backends (and says how many there were).
NAMED = 10


class Gate:
    """A counting semaphore that knows how many hold it (`in_flight`), the most that ever did, and how many
    requests it let through in all (`done`)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._slots = threading.Semaphore(limit)
        self._lock = threading.Lock()
        self.in_flight = 0
        self.peak = 0
        self.done = 0  # requests answered (or failed) so far: a working pass's progress

    def __enter__(self) -> Gate:
        self._slots.acquire()
        with self._lock:
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self.in_flight -= 1
            self.done += 1
        self._slots.release()


def late_backends(
    interval_s: float, started: Mapping[str, float], finished: Mapping[str, float], begun: float
) -> list[str]:
    """The backends of a pass begun at ``begun`` (monotonic seconds) that finished after its interval was
    up, slowest (longest probing, from each one's own start) first."""
    due = begun + interval_s
    late = [b for b, end in finished.items() if end > due]
    return sorted(late, key=lambda b: (started[b] - finished[b], b))
