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
next pass renews it in time. A lease also ends early when its holder's **presence** is gone: each daemon
keeps one idle connection whose ``application_name`` is ``canaryd <token>`` (`presence_name`), recorded in
its lease rows, and a claim takes a lease whose presence no longer shows in ``pg_stat_activity``. A daemon
killed with SIGKILL loses that connection at once (the kernel closes its socket), so a standby that asks
at the dead holder's next due time (`Daemon._claim`) probes the backend on time: no pass is missed. A hung
holder keeps its connection, hence its presence: its backends go when its leases end, as before. A
presence is recorded only while it is visible through the database's own connections (a pooler that
hides it leaves the column NULL, and that holder's leases simply expire). SQLite keeps the single-daemon
behaviour: no lease is written and every backend is this daemon's.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from sqlalchemy import Connection, text

from canaryd.store.engine import Connected

# A late pass keeps its lease if it starts within this share of an interval (APScheduler's own lateness
# is milliseconds; a busy machine or a slow database adds more), at least GRACE_MIN_S, at most GRACE_MAX_S.
GRACE = 0.25
GRACE_MIN_S = 1.0
GRACE_MAX_S = 30.0

_CLAIM = text("""
INSERT INTO lease (backend, holder, expires, presence)
SELECT b, :holder, now() + make_interval(secs => s),
       (SELECT a.application_name FROM pg_stat_activity a
        WHERE a.application_name = CAST(:presence AS text) LIMIT 1)
FROM unnest(CAST(:backends AS text[]), CAST(:seconds AS float8[])) AS t(b, s)
ON CONFLICT (backend) DO UPDATE
SET holder = excluded.holder, expires = excluded.expires, presence = excluded.presence
WHERE lease.expires < now() OR lease.holder = excluded.holder
   OR (lease.presence IS NOT NULL
       AND NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.application_name = lease.presence))
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


def presence_name(holder: str) -> str:
    """The ``application_name`` of a holder's presence connection: short and ASCII (PostgreSQL keeps 63
    bytes of it, and replaces other characters), unique by the holder's token."""
    return "canaryd " + holder.rpartition("#")[2]


class Leases(Connected):
    """The store's leases (a mixin of `canaryd.store.Store`, which sets ``lease_holder``)."""

    lease_holder: str  # `holder_name`: this process's name in the lease table
    _presence: Connection | None = None  # the idle connection that says this process is alive
    _presence_lock: threading.Lock  # the daemon's passes claim from several threads

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
        presence = self._present()
        with self.engine.begin() as conn:
            mine = conn.execute(
                _CLAIM,
                {
                    "holder": self.lease_holder,
                    "presence": presence,
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

    def _present(self) -> str | None:
        """This process's presence name, its connection (re)opened if it is not alive; None when it cannot
        be (the claim then records no presence, and this holder's leases only expire)."""
        with self._presence_lock:
            conn = self._presence
            try:
                if conn is not None:
                    conn.exec_driver_sql("SELECT 1")
                    return presence_name(self.lease_holder)
            except Exception:
                with contextlib.suppress(Exception):
                    conn.close()
            self._presence = None
            name = presence_name(self.lease_holder)
            try:
                conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
                conn.execute(text("SELECT set_config('application_name', :n, false)"), {"n": name})
            except Exception:
                return None
            self._presence = conn  # held, never returned to the pool: no other thread ever gets it
            return name

    def end_presence(self) -> None:
        """Close the presence connection (the store closes)."""
        with self._presence_lock:
            if self._presence is not None:
                self._presence.close()
                self._presence = None

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
