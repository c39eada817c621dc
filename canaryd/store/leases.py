"""Leases: in a fleet of daemons on one PostgreSQL database, each backend is probed by one live daemon.

A lease is a row per backend: its holder (one daemon process) and an expiry. A daemon claims the backends
of a pass before probing them, in one statement per pass::

    INSERT … ON CONFLICT (backend) DO UPDATE … WHERE lease.expires < now() OR lease.holder = me RETURNING

so a backend goes to whoever asks first once its lease has run out, and its holder renews it on every
pass; the statement is atomic (a concurrent claim of the same row waits for the first, then sees its
result), and the expiry is on the database's clock (``now()``), so daemons whose clocks disagree still
agree on who holds what. A clean stop deletes the daemon's rows: the others take over at their next pass.

Why leases rather than session advisory locks (``pg_try_advisory_lock``): a lock lives as long as its
connection. A SIGKILLed daemon's connection dies and its locks free, but a hung daemon (SIGSTOP, a frozen
VM, a deadlocked pass) keeps its connection, hence its backends, for ever; and a lock belongs to one pooled
connection, not to the process, so the pool could hand it to a thread that never asked for it. A lease
that is not renewed simply ends: a dead or a hung holder loses its backends one lease length after its
last pass, and the lease table says who holds what (``SELECT * FROM lease``).

A lease lasts `lease_seconds` (one interval, the schedule's jitter and a grace for a late pass): a holder's
next pass renews it in time, and a daemon killed with SIGKILL has its backends taken over when their leases
end (a standby learns from a failed claim when that is, and asks again then: see the daemon's
``Daemon._claim``). SQLite keeps the single-daemon behaviour:
no lease is written and every backend is this daemon's.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from sqlalchemy import text

from canaryd.store.engine import Connected

# A late pass keeps its lease if it starts within this share of an interval (APScheduler's own lateness
# is milliseconds; a busy machine or a slow database adds more), at least GRACE_MIN_S, at most GRACE_MAX_S.
GRACE = 0.25
GRACE_MIN_S = 1.0
GRACE_MAX_S = 30.0

_CLAIM = text("""
INSERT INTO lease (backend, holder, expires)
SELECT b, :holder, now() + make_interval(secs => s)
FROM unnest(CAST(:backends AS text[]), CAST(:seconds AS float8[])) AS t(b, s)
ON CONFLICT (backend) DO UPDATE SET holder = excluded.holder, expires = excluded.expires
WHERE lease.expires < now() OR lease.holder = excluded.holder
RETURNING backend
""")
_HOLDERS = text(
    "SELECT backend, holder, extract(epoch FROM expires - now()) FROM lease "
    "WHERE backend = ANY(CAST(:backends AS text[]))"
)


def lease_seconds(interval_s: float, jitter_s: float = 0.0) -> float:
    """How long a pass's claim lasts: until the holder's next pass (one interval, plus up to ``jitter_s``
    of APScheduler's jitter, which only delays a pass) is due, plus a grace for a pass that starts late.
    A longer lease delays a takeover; a shorter one hands a backend over whenever a pass starts late."""
    return interval_s + jitter_s + min(max(GRACE * interval_s, GRACE_MIN_S), GRACE_MAX_S)


class Lease(NamedTuple):
    """A backend's lease after a claim: its holder (None: nobody, a row deleted meanwhile) and the seconds
    until it ends, on the database's clock (so a standby can ask again right then)."""

    holder: str | None
    ends_in: float


def holder_name(instance: str) -> str:
    """This process's name as a lease holder: the instance and a token unique to the process, so that two
    daemons sharing an instance name (a misconfiguration, or a restart while the old process hangs) never
    both hold a lease."""
    return f"{instance}#{uuid.uuid4().hex[:8]}"


class Leases(Connected):
    """The store's leases (a mixin of `canaryd.store.Store`, which sets ``lease_holder``)."""

    lease_holder: str  # `holder_name`: this process's name in the lease table

    @property
    def leased(self) -> bool:
        """Whether backends are leased (PostgreSQL); on SQLite this daemon holds them all."""
        return self.engine.dialect.name == "postgresql"

    def claim_leases(self, seconds: Mapping[str, float]) -> dict[str, Lease]:
        """Take or renew the lease of each backend (for its number of seconds from now, on the database's
        clock) unless another live holder has it; every backend's lease after the claim (held by
        `lease_holder` where this process got it)."""
        if not self.leased:
            return {b: Lease(self.lease_holder, s) for b, s in seconds.items()}
        names = sorted(seconds)  # one lock order for every claimer: overlapping claims cannot deadlock
        with self.engine.begin() as conn:
            mine = conn.execute(
                _CLAIM,
                {
                    "holder": self.lease_holder,
                    "backends": names,
                    "seconds": [float(seconds[b]) for b in names],
                },
            ).scalars()
            leases = {b: Lease(self.lease_holder, seconds[b]) for b in mine}
            rest = [b for b in names if b not in leases]
            if rest:
                for b, holder, ends_in in conn.execute(_HOLDERS, {"backends": rest}):
                    leases[b] = Lease(holder, max(0.0, float(ends_in)))
        return {b: leases.get(b, Lease(None, 0.0)) for b in names}

    def release_leases(self, backends: Iterable[str] | None = None) -> int:
        """End this process's leases (default: all of them) so another daemon takes the backends over at
        its next pass rather than at the leases' expiry; how many ended."""
        if not self.leased:
            return 0
        sql = "DELETE FROM lease WHERE holder = :holder"
        params: dict[str, object] = {"holder": self.lease_holder}
        if backends is not None:
            sql += " AND backend = ANY(CAST(:backends AS text[]))"
            params["backends"] = list(backends)
        with self.engine.begin() as conn:
            return conn.execute(text(sql), params).rowcount
