"""What one daemon carries: the in-flight cap on its requests, the backends a pass can afford, and the
passes that overran their interval.

The cap (``[daemon] max_in_flight``) is a `Gate` every backend of the daemon shares: each request attempt
(and each snapshot) holds it while it is out, so a thousand backends with ``concurrency = 4`` each never
put four thousand requests in flight at once, whatever each backend's own limit allows. The passes'
backends run on a pool of the same size: no thread per backend.

A pass that takes longer than its schedule's interval overran: the next one is skipped or late. It is
counted (``canaryd_schedule_overruns_total``) and logged with the backends that made it late, those still
probing when the interval was up (`late_backends`): the slowest of them is where to look, and a daemon
whose passes keep overrunning carries too much (docs/fleets.md: when to add a daemon). A backend whose
pass would spend past its daily budget is left out of it (`affordable`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import structlog

from canaryd.probe.budget import over_budget

if TYPE_CHECKING:
    from canaryd.canaries import Canary
    from canaryd.config import Config
    from canaryd.daemon.metrics import Metrics
    from canaryd.store import Store

log = structlog.get_logger("canaryd.daemon")

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


def affordable(
    store: Store, metrics: Metrics, config: Config, schedule: str, work: dict[str, list[Canary]]
) -> dict[str, list[Canary]]:
    """The backends whose pass fits their daily budget; a skipped one is logged and counted (a budget
    that cannot be read skips nothing: the store's failure shows elsewhere)."""
    fits = {}
    for b, canaries in work.items():
        try:
            why = over_budget(store, config.backend(b), canaries)
        except Exception:
            log.exception("budget.read_failed", backend=b)
            why = None
        if why is None:
            fits[b] = canaries
        else:
            log.warning("budget.skip", schedule=schedule, backend=b, reason=why)
            metrics.budget_skips.labels(b).inc()
    return fits


def overran(
    metrics: Metrics,
    gate: Gate,
    schedule: str,
    interval: float,
    begun: float,
    started: Mapping[str, float],
    finished: Mapping[str, float],
) -> None:
    """The pass's duration as a gauge; one longer than its schedule's interval is counted and logged,
    naming the backends still probing when the interval was up (the slowest first)."""
    took = time.monotonic() - begun
    metrics.schedule_duration.labels(schedule).set(took)
    overruns = metrics.schedule_overruns.labels(schedule)
    if took <= interval:
        return
    overruns.inc()
    late = late_backends(interval, started, finished, begun)
    log.warning(
        "pass_overran",
        duration_s=round(took, 3),
        interval_s=interval,
        late=len(late),
        backends=late[:NAMED],
        in_flight_cap=gate.limit,
    )
