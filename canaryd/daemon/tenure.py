"""Which backends this daemon probes, pass to pass, in a fleet of daemons sharing one PostgreSQL database
(`canaryd.store.leases`): each change of a lease is logged and exported."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, wait

import structlog

from canaryd.daemon.metrics import Metrics
from canaryd.store import Store
from canaryd.store.leases import Plan

log = structlog.get_logger("canaryd.daemon")

# A pass still working renews the leases of its backends this share of a lease apart.
RENEW = 1 / 3


class Tenure:
    """Which backends this daemon probes, pass to pass: each change is logged and exported
    (`Metrics.set_lease`). On SQLite every backend is held, silently."""

    def __init__(self, store: Store, metrics: Metrics) -> None:
        self.store, self.metrics = store, metrics
        self.holders: dict[str, str | None] = {}  # backend -> its holder at the last claim
        self._plan: Plan | None = None  # the plan of the last claim (what the share is of)
        self._lock = threading.Lock()  # passes of several schedules claim at once

    def claim(
        self, lease_s: dict[str, float], backends: list[str], plan: Plan | None = None
    ) -> tuple[set[str], dict[str, float]]:
        """Claim the backends' leases, shared by the plan (if any: `canaryd.store.leases`): (those this
        daemon holds now, the seconds until each other one's lease ends). A claim that fails (the database
        is unreachable) holds nothing: the passes skip them, and their last-probe times age."""
        me = self.store.lease_holder
        try:
            leases = self.store.claim_leases({b: lease_s[b] for b in backends}, plan)
        except Exception:
            log.exception("lease.claim_failed", backends=backends)
            return set(), {}
        with self._lock:
            for b, (holder, _) in leases.items():
                before = self.holders.get(b, "")  # "": never claimed by this daemon
                self.holders[b] = holder
                if (before == me) == (holder == me) and before != "":
                    continue
                self.metrics.set_lease(b, holder == me)
                if not self.store.leased:
                    continue
                if holder == me:  # a takeover (from a holder that died, hung or stopped) is worth a warning;
                    # a handover from a live daemon (the fleet's shares moved) is not
                    taken = before not in ("", None) and before not in self.store.fleet_view()
                    (log.warning if taken else log.info)(
                        "lease.acquired", backend=b, previous=before or None, seconds=lease_s[b]
                    )
                elif before == me:
                    log.warning("lease.lost", backend=b, holder=holder)
                else:
                    log.info("lease.held_elsewhere", backend=b, holder=holder)
            if plan is not None:
                self._plan = plan
                self._share(plan)
        held = {b for b, lease in leases.items() if lease.holder == me}
        return held, {b: lease.ends_in for b, lease in leases.items() if b not in held}

    def _share(self, plan: Plan) -> None:
        """Export what this daemon holds of the plan's backends, and how many daemons share them."""
        me = self.store.lease_holder
        held = [b for b in plan.weight if self.holders.get(b) == me]
        total = sum(plan.weight.values()) or 1.0
        self.metrics.fleet_backends.set(len(held))
        self.metrics.fleet_share.set(sum(plan.weight[b] for b in held) / total)
        self.metrics.fleet_daemons.set(len(self.store.fleet_view()))

    def keep(
        self,
        lease_s: Mapping[str, float],
        futures: Mapping[str, Future],
        progress: Callable[[], int],
        plan: Plan | None = None,
    ) -> None:
        """Wait for the pass's backends, renewing their leases every `RENEW` of a lease while the daemon
        makes progress (``progress``, its requests answered, moved since the last renewal): a pass longer
        than its lease (a first contact's baselines, a slow server) keeps its backends, the finished ones
        too (their next pass comes when this one ends; let go, they went to whichever daemon claimed first
        and came back a pass later), in one statement per renewal. Only a lease that would end before
        the next renewal (with half a period to spare) is extended: a pass of usual length leaves its
        leases as claimed, so the others' takeovers stay timed on its holder's passes; and with the
        fleet's ``plan``, only those of backends that hash here (one another live daemon owns is taken
        at this one's next due pass, `Store.renew_leases`). A hung daemon renews nothing, and its leases
        end at their expiry."""
        if not futures or not self.store.leased:
            wait(futures.values())
            return
        period = min(lease_s[b] for b in futures) * RENEW
        pending, due, seen = set(futures.values()), time.monotonic() + period, progress()
        lost: set[str] = set()
        while pending:
            _, pending = wait(pending, timeout=max(due - time.monotonic(), 0.0))
            if not pending or time.monotonic() < due:
                continue
            due = time.monotonic() + period
            if progress() == seen:
                log.info("lease.not_renewed", reason="no request answered", pending=len(pending))
                continue
            seen = progress()
            rest = {b: lease_s[b] for b in futures if b not in lost}
            try:
                kept = self.store.renew_leases(rest, within=period * 1.5, plan=plan)
            except Exception:
                log.exception("lease.renew_failed", backends=len(rest))
                continue
            log.debug("lease.renewed", backends=len(kept))
            lost |= set(rest) - kept
            self.lose(set(rest) - kept, "taken during its pass")

    def lose(self, backends: set[str], reason: str) -> None:
        """Backends taken from this daemon since its last claim (found as a pass sets out, a worker starts
        one, or a renewal): logged, and no longer exported as held, nor counted in its share."""
        me = self.store.lease_holder
        with self._lock:
            for b in sorted(backends):
                log.warning("lease.lost", backend=b, reason=reason)
                if self.holders.get(b) == me:
                    # as never claimed: the next claim drops again the series a pass recorded since
                    del self.holders[b]
                    self.metrics.set_lease(b, False)
            if self._plan is not None and backends:
                self._share(self._plan)

    def forget(self, backends: set[str]) -> None:
        """Backends a reload removed: their leases end now, and a later reload that adds one back starts
        afresh (its series were dropped with it)."""
        with self._lock:
            for b in backends:
                self.holders.pop(b, None)
        if backends:
            try:
                self.store.release_leases(backends)
            except Exception:
                log.exception("lease.release_failed", backends=sorted(backends))
