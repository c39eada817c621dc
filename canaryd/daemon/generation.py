"""A `Generation`: everything the daemon builds from one config (backends, each schedule's work, the
leases' lengths), replaced whole on a reload (SIGHUP) and closed once its last pass is done.

Its backends are built once, with the daemon's stop event, and every pass of the generation probes them:
a backend named as another's reference answers its checks as the same object (`canaryd.probe.run`), so
its circuit breaker and its stop event hold for both.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from canaryd.backends import make_backend
from canaryd.canaries import Canary, load_suites
from canaryd.config import Config
from canaryd.daemon.capacity import Gate
from canaryd.daemon.refused import Guarded
from canaryd.errors import InputError
from canaryd.probe.run import plan
from canaryd.shares import weights
from canaryd.store import lease_seconds
from canaryd.store.leases import Plan, spacing


@dataclass
class Generation:
    """Everything built from one config: backends and each schedule's work. Replaced whole on reload."""

    config: Config
    backends: dict[str, Guarded]
    work: dict[str, dict[str, list[Canary]]]  # schedule -> backend -> canaries
    lease_s: dict[str, float]  # backend -> how long a pass's claim lasts (its most frequent schedule's)
    lead: dict[str, str]  # backend -> that schedule: the one a takeover pass runs
    gap_s: dict[str, float]  # backend -> the longest wait between two passes of that schedule
    interval_s: dict[str, float]  # schedule -> its interval
    spacing_s: dict[str, float]  # schedule -> the least time between two probes of a backend it leads
    plan: Plan  # what the fleet's daemons share the backends by (`canaryd.shares`)
    active: int = 0
    retired: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def build(
        cls, config: Config, stopping: threading.Event | None = None, gate: Gate | None = None
    ) -> Generation:
        """Validate everything a pass needs up front, so a bad reload never reaches the scheduler.
        ``gate``: the daemon's in-flight cap, which every generation's backends share."""
        suites = load_suites([s.path for s in config.suites], config.limits.suite_bytes)
        names = {s.name for s in suites}
        full = plan(config, suites)
        work: dict[str, dict[str, list[Canary]]] = {}
        for i, sched in enumerate(config.schedules):
            for name in sched.suites or ():
                if name not in names:
                    raise InputError(f"{config.path}: schedules[{i}].suites: unknown suite {name!r}")
            work[sched.name] = {
                b: [c for c in canaries if sched.suites is None or c.suite in sched.suites]
                for b, canaries in full.items()
                if sched.backends is None or b in sched.backends
            }
        lease_s: dict[str, float] = {}
        lead: dict[str, str] = {}
        gap_s: dict[str, float] = {}
        interval_s = {sched.name: sched.interval_s for sched in config.schedules}
        for sched in config.schedules:
            for b in work[sched.name]:
                s = lease_seconds(sched.longest_gap_s, sched.jitter)
                if s < lease_s.get(b, float("inf")):
                    lease_s[b], lead[b], gap_s[b] = s, sched.name, sched.longest_gap_s
        # each backend holds back what it refused as configured until this generation is replaced (reload)
        backends = {b.name: Guarded(make_backend(b, stopping, gate)) for b in config.backends}
        weight = weights({s: {b: len(cs) for b, cs in w.items()} for s, w in work.items()}, interval_s)
        shares = Plan(weight, {b: lease_s[b] - gap_s[b] for b in lease_s}, min(lease_s.values(), default=0.0))
        spacing_s = {sched.name: spacing(sched.interval_s, sched.jitter) for sched in config.schedules}
        return cls(config, backends, work, lease_s, lead, gap_s, interval_s, spacing_s, shares)

    def work_pairs(self) -> dict[str, set[str]]:
        """Every backend with the ids of the canaries any schedule sends it."""
        pairs: dict[str, set[str]] = {}
        for per_backend in self.work.values():
            for b, canaries in per_backend.items():
                pairs.setdefault(b, set()).update(i for c in canaries for i in c.observed_ids())
        return pairs

    def acquire(self) -> None:
        with self.lock:
            self.active += 1

    def release(self) -> None:
        with self.lock:
            self.active -= 1
            done = self.retired and self.active == 0
        if done:
            self.close()

    def retire(self) -> None:
        with self.lock:
            self.retired = True
            idle = self.active == 0
        if idle:
            self.close()

    def close(self) -> None:
        for b in self.backends.values():
            b.close()
