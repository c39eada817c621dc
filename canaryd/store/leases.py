"""Leases: in a fleet of daemons on one PostgreSQL database, each backend is probed by one live daemon.

A lease is a row per backend: its holder (one daemon process) and an expiry. A daemon claims the backends
of a pass before probing them, in one statement per pass::

    INSERT … ON CONFLICT (backend) DO UPDATE … WHERE lease.expires < now() OR lease.holder = me RETURNING

so a backend goes to whoever asks first once its lease has run out, and its holder renews it on every pass (in
a fleet, unless it hashes to another live daemon: *Shares*, below); the statement is atomic (a concurrent
claim of the same row waits for the first, then sees its result), and the expiry is on the database's clock
(``now()``), so daemons whose clocks disagree still agree on who holds what. A clean stop ends the daemon's
leases: the others take over at its next pass.

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
at the dead holder's next due time (`Daemon._claim`) probes the backend on time: no pass is missed. With a
`Plan` (a daemon's claims) such a lease is taken only from `EARLY_S` before that next pass, never sooner:
the holder may have renewed it and probed the backend just before it died; unless it died between its
claim and its probe (its pass marks ``lease.probed`` as it sets out, `start_probes`, and again as each
backend's probes start, `started_probe`): then from an interval after its last probe, at once if it never
probed. A pass longer than its lease renews its leases while it makes progress (`renew_leases`). A hung
holder keeps its connection, hence its presence: its backends go when its leases end, as before. A
presence is recorded only while it is visible through the database's own connections (a pooler that
hides it leaves the column NULL, and that holder's leases simply expire). SQLite keeps the single-daemon
behaviour: no lease is written and every backend is this daemon's.

**Shares.** With a `Plan` (the daemon's claims), the fleet shares the backends: each claim first records this
daemon in the ``daemon`` table (its presence, its last claim or renewal ``seen``, its shortest lease), reads
the live daemons (presence showing, ``seen`` within their lease) and computes who probes each backend
(`canaryd.shares.assign`: every daemon computes the same from the same rows). A backend that hashes to this
daemon but is held by another live one is taken from it at its holder's next pass (from `EARLY_S` before it is
due: the holder probed it an interval ago, and does not probe it again, since its own claim then finds it
taken): the handover needs no release, so it only happens once the new owner is live and asking, and no pass
is missed or doubled. The holder's claims no longer renew that lease, so a takeover pass that a loaded machine
starts after the holder's claim still takes it: if the holder's worker probed it meanwhile, the new owner
finds it probed too recently and probes it on that phase; if not, the new owner probes it at once (the
holder's pass marks it only as its worker starts it, `start_probes`). Whoever probes a backend, the next probe
comes no sooner than its `spacing` after the last (``lease.probed``, `Leases.start_probes`): a new owner's
regular pass, whose phase is not its previous holder's, skips it, and the daemon probes it on that phase
instead. Any other backend is claimed as before (free, expired, or its holder's presence gone, at its next
pass), so nothing waits for its owner to come. A daemon that stops deletes its row and marks its leases with
its presence, which its store then closes: they are taken at its next passes, as a killed one's are; a killed
one's row stays (not live) until pruned.
"""

from __future__ import annotations

import contextlib
import math
import threading
import uuid
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from sqlalchemy import Connection, text

from canaryd.shares import assign
from canaryd.store.engine import Connected

# A late pass keeps its lease if it starts within this share of an interval (APScheduler's own lateness
# is milliseconds; a busy machine or a slow database adds more), at least GRACE_MIN_S, at most GRACE_MAX_S.
GRACE = 0.25
GRACE_MIN_S = 1.0
GRACE_MAX_S = 30.0

# A backend that hashes here is taken from a live holder this long before the holder's next pass is due
# (a standby asks `TAKEOVER_EARLY_S` before it, `canaryd.daemon.service`).
EARLY_S = 0.5
# A backend is probed again no sooner than its lead schedule's interval, less the schedule's jitter and this
# slack (this share of the interval, at least SPACING_MIN_S: a takeover's `EARLY_S`, and how much later one
# pass than the next may set out after its claim), whoever probed it last (`Leases.start_probes`).
SPACING = 0.05
SPACING_MIN_S = 1.0
# A dead daemon's row (presence gone, or not seen for this many of its leases) is deleted by the next claim.
PRUNE_LEASES = 10

_VISIBLE = (
    "(SELECT a.application_name FROM pg_stat_activity a "
    "WHERE a.application_name = CAST(:presence AS text) LIMIT 1)"
)
_HEARTBEAT = text(f"""
INSERT INTO daemon (holder, instance, presence, started, seen, lease_s)
VALUES (:holder, :instance, {_VISIBLE}, now(), now(), :lease_s)
ON CONFLICT (holder) DO UPDATE SET presence = excluded.presence, seen = now(), lease_s = excluded.lease_s
""")
_LIVE_WHERE = (
    "d.seen + make_interval(secs => d.lease_s) > now() AND (d.presence IS NULL OR EXISTS "
    "(SELECT 1 FROM pg_stat_activity a WHERE a.application_name = d.presence))"
)
_LIVE = text(f"SELECT d.holder FROM daemon d WHERE {_LIVE_WHERE}")
_PRUNE = text(
    f"DELETE FROM daemon WHERE holder IN (SELECT d.holder FROM daemon d WHERE d.holder <> :holder "
    f"AND NOT ({_LIVE_WHERE}) AND d.seen + make_interval(secs => d.lease_s * {PRUNE_LEASES}) < now() "
    "FOR UPDATE SKIP LOCKED)"
)
# A lease whose holder's presence no longer shows: the holder was killed, lost its connection or stopped.
_GONE = (
    "(lease.presence IS NOT NULL "
    "AND NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.application_name = lease.presence))"
)
# Backends held by another daemon whose next pass is due within EARLY_S (its lease's end less the grace the
# lease adds to its interval), and that hash here or whose holder is gone: the holder probed them in its
# last pass, so they are taken when it would have probed them next, never sooner (a gone holder's, from
# `EARLY_S` before an interval after it last set out to probe it, `lease.probed`: at once if it never did).
# `_LOCK` first locks them in the one order of every claimer (the claim's upsert, a statement of its own,
# takes its rows in that order too): no deadlock; `_TAKE` checks the same again on the locked rows.
_DUE = f"""lease.holder <> :holder AND (lease.backend = ANY(CAST(:ours AS text[])) OR {_GONE})
  AND (lease.expires - make_interval(secs => t.g + {EARLY_S}) <= now()
       OR ({_GONE}
           AND COALESCE(lease.probed + make_interval(secs => t.s - t.g - {EARLY_S}), now()) <= now()))"""
_LOCK = text(f"""
SELECT lease.backend FROM lease
JOIN unnest(CAST(:backends AS text[]), CAST(:seconds AS float8[]), CAST(:graces AS float8[])) AS t(b, s, g)
  ON lease.backend = t.b
WHERE {_DUE}
ORDER BY lease.backend FOR UPDATE OF lease
""")
_TAKE = text(f"""
UPDATE lease SET holder = :holder, expires = now() + make_interval(secs => t.s), presence = {_VISIBLE},
       weight = t.w
FROM unnest(CAST(:backends AS text[]), CAST(:seconds AS float8[]), CAST(:graces AS float8[]),
            CAST(:weights AS float8[])) AS t(b, s, g, w)
WHERE lease.backend = t.b AND {_DUE}
""")
_CLAIM_SQL = f"""
INSERT INTO lease (backend, holder, expires, presence, weight)
SELECT b, :holder, now() + make_interval(secs => s), {_VISIBLE}, w
FROM unnest(CAST(:backends AS text[]), CAST(:seconds AS float8[]), CAST(:weights AS float8[])) AS t(b, s, w)
ON CONFLICT (backend) DO UPDATE
SET holder = excluded.holder, expires = excluded.expires, presence = excluded.presence,
    weight = excluded.weight
WHERE lease.expires < now()
   OR (lease.holder = excluded.holder AND lease.backend <> ALL(CAST(:theirs AS text[]))){{gone}}
RETURNING backend
"""
# With a `Plan`, a gone holder's leases are `_TAKE`n at its next pass; without one (no grace known), at once.
_CLAIM = text(_CLAIM_SQL.format(gone=""))
_CLAIM_GONE = text(_CLAIM_SQL.format(gone=f" OR {_GONE}"))
# Marks the rows locked first in the claimers' one order (no deadlock with a claim or a take), those of them
# whose last probe (whoever made it) is at least their spacing ago; a row without a spacing, or not to be
# stamped (``stamp``), is only checked.
_PROBED = text("""
WITH mine AS (
  SELECT lease.backend, lease.probed, t.g, t.st FROM lease
  JOIN unnest(CAST(:backends AS text[]), CAST(:spacing AS float8[]), CAST(:stamp AS boolean[])) AS t(b, g, st)
    ON lease.backend = t.b
  WHERE lease.holder = :holder ORDER BY lease.backend FOR UPDATE OF lease),
marked AS (
  UPDATE lease SET probed = CASE WHEN mine.g IS NULL OR NOT mine.st THEN lease.probed ELSE now() END FROM mine
  WHERE lease.backend = mine.backend
    AND (mine.g IS NULL OR mine.probed IS NULL OR mine.probed + make_interval(secs => mine.g) <= now())
  RETURNING lease.backend)
SELECT mine.backend, marked.backend IS NOT NULL, extract(epoch FROM now() - mine.probed)
FROM mine LEFT JOIN marked ON marked.backend = mine.backend
""")
# Extends this holder's leases of a pass still working (never shortens one; a row whose ``renew`` is false
# is only said held), locked in the claimers' order.
_RENEW = text("""
WITH mine AS (
  SELECT lease.backend, t.s, t.r FROM lease
  JOIN unnest(CAST(:backends AS text[]), CAST(:seconds AS float8[]), CAST(:renew AS boolean[])) AS t(b, s, r)
    ON lease.backend = t.b
  WHERE lease.holder = :holder ORDER BY lease.backend FOR UPDATE OF lease)
UPDATE lease SET expires = CASE WHEN mine.r AND lease.expires < now() + make_interval(secs => :within)
  THEN GREATEST(lease.expires, now() + make_interval(secs => mine.s)) ELSE lease.expires END FROM mine
WHERE lease.backend = mine.backend
RETURNING lease.backend
""")
# A worker starts probing a backend: still this holder's? Then (``mark``) its last probe is now.
_STARTED = text(
    "UPDATE lease SET probed = CASE WHEN :mark THEN now() ELSE probed END "
    "WHERE backend = :backend AND holder = :holder RETURNING backend"
)
_HOLDERS = text(
    "SELECT backend, holder, extract(epoch FROM expires - now()) FROM lease "
    "WHERE backend = ANY(CAST(:backends AS text[]))"
)


def spacing(interval_s: float, jitter_s: float = 0.0) -> float:
    """The least time between two probes of a backend whose lead schedule has this interval and jitter."""
    return max(0.0, interval_s - jitter_s - max(SPACING * interval_s, SPACING_MIN_S))


def lease_seconds(interval_s: float, jitter_s: float = 0.0) -> float:
    """How long a pass's claim lasts: until the holder's next pass (one interval, plus up to ``jitter_s``
    of APScheduler's jitter, which only delays a pass) is due, plus a grace for a pass that starts late.
    A longer lease delays a takeover; a shorter one hands a backend over whenever a pass starts late."""
    return interval_s + jitter_s + min(max(GRACE * interval_s, GRACE_MIN_S), GRACE_MAX_S)


class Plan(NamedTuple):
    """What a daemon's claims share the backends by (`canaryd.daemon.generation.Generation.plan`): every
    backend's weight (`canaryd.shares.weights`), the grace its lease adds to its holder's interval (so a
    claim knows when the holder's next pass is due), and this daemon's shortest lease (it is live while its
    last claim is more recent)."""

    weight: Mapping[str, float]
    grace: Mapping[str, float]
    live_s: float


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
    instance: str
    _assigned: tuple[tuple, dict[str, str]] | None = None  # ((live set, weights), assignment) last computed

    @property
    def leased(self) -> bool:
        """Whether backends are leased (PostgreSQL); on SQLite this daemon holds them all."""
        return self.engine.dialect.name == "postgresql"

    def claim_leases(self, seconds: Mapping[str, float], plan: Plan | None = None) -> dict[str, Lease]:
        """Take or renew the lease of each backend (for its number of seconds from now, on the database's
        clock) unless another live holder has it, or, with a `Plan`, unless it hashes to this daemon and
        its holder's next pass is due; every backend's lease after the claim (held by `lease_holder` where
        this process got it). With a `Plan`, a lease this daemon holds of a backend that hashes to another
        live daemon is not renewed: it stays this daemon's until that one takes it, which it may from
        then on, however late its takeover pass comes (a loaded machine delays it past this claim)."""
        if not self.leased:
            return {b: Lease(self.lease_holder, s) for b, s in seconds.items()}
        names = sorted(seconds)  # one lock order for every claimer: overlapping claims cannot deadlock
        presence = self._present()
        params = {
            "holder": self.lease_holder,
            "presence": presence,
            "backends": names,
            "seconds": [float(seconds[b]) for b in names],
            "weights": [plan.weight.get(b) if plan else None for b in names],
            "theirs": [],
        }
        if plan is not None:  # its own transaction: the claim below locks the rows in one statement
            self._heartbeat(plan, presence)
            with self.engine.begin() as conn:
                self._assign(conn, plan)
                ours = self._ours()
                params["theirs"] = sorted(set(names) & self._theirs())
                graces = [float(plan.grace[b]) for b in names]
                lock = {k: params[k] for k in ("holder", "backends", "seconds")}
                lock.update(graces=graces, ours=ours)
                due = conn.execute(_LOCK, lock).scalars().all()
                if due:
                    take = dict(params, backends=due, seconds=[float(seconds[b]) for b in due], ours=ours)
                    take["graces"] = [float(plan.grace[b]) for b in due]
                    take["weights"] = [plan.weight[b] for b in due]
                    conn.execute(_TAKE, take)
        with self.engine.begin() as conn:
            mine = conn.execute(_CLAIM if plan is not None else _CLAIM_GONE, params).scalars()
            leases = {b: Lease(self.lease_holder, seconds[b]) for b in mine}
            rest = [b for b in names if b not in leases]
            if rest:
                for b, holder, ends_in in conn.execute(_HOLDERS, {"backends": rest}):
                    leases[b] = Lease(holder, max(0.0, float(ends_in)))
        return {b: leases.get(b, Lease(None, 0.0)) for b in names}

    def start_probes(self, spacing_s: Mapping[str, float | None]) -> tuple[set[str], dict[str, float]]:
        """Of the backends a pass claimed (each with the least spacing from its last probe, `spacing`; None:
        a pass of a schedule other than its lead, which neither checks nor marks it), those still this
        daemon's as it sets out to probe them, marked probed (``lease.probed``, on the database's clock),
        and those probed too recently, with the seconds since their last probe. A standby then takes a
        dead holder's backend an interval after the holder last probed it, not sooner, and not later; and
        a new holder never probes a backend its previous holder probed less than an interval ago. One that
        hashes to another live daemon is checked but not marked: that daemon may take it before this pass's
        worker reaches it, and must then see the last probe that was made, not this pass's intent (it
        would wait an interval more). A worker that does probe it stamps it as it starts (`started_probe`)."""
        if not self.leased:
            return set(spacing_s), {}
        names = sorted(spacing_s)
        theirs = self._theirs()
        params = {
            "holder": self.lease_holder,
            "backends": names,
            "spacing": [spacing_s[b] for b in names],
            "stamp": [b not in theirs for b in names],
        }
        kept: set[str] = set()
        early: dict[str, float] = {}
        with self.engine.begin() as conn:
            for b, marked, age in conn.execute(_PROBED, params):
                if marked:
                    kept.add(b)
                else:
                    early[b] = float(age)
        return kept, early

    def started_probe(self, backend: str, mark: bool) -> bool:
        """A worker of a pass starts probing the backend: whether it is still this daemon's (a lease lost
        since the pass set out is not probed) and, with ``mark``, its last probe stamped now, on the
        database's clock. The spacing was checked as the pass set out (`start_probes`); this stamp moves
        the last probe to when it actually began, so the next one is spaced from it."""
        if not self.leased:
            return True
        params = {"holder": self.lease_holder, "backend": backend, "mark": mark}
        with self.engine.begin() as conn:
            return conn.execute(_STARTED, params).first() is not None

    def renew_leases(
        self, seconds: Mapping[str, float], within: float = math.inf, plan: Plan | None = None
    ) -> set[str]:
        """Extend this daemon's leases of a working pass's backends that end within ``within`` seconds (each
        to at least its number of seconds from now), in one statement; those still held. A lease is extended
        only when it must be: the others' takeovers are timed from its end, so a pass of usual length leaves
        it as claimed. With a `Plan`, only the leases of backends that hash here (to the live set read now)
        are extended (the others still held are returned too): one that hashes to another live daemon is left
        to end, and that daemon takes it when this one's next pass was due, however long this pass runs (a
        worker that has yet to start it then finds it taken); and the renewal records this daemon live, as a
        claim does (a pass longer than its lease does not drop it from the live set). Only a pass that makes
        progress renews (`canaryd.daemon.service`): a hung one's leases end at their expiry, and it leaves the
        live set as its last renewal ages."""
        if not self.leased or not seconds:
            return set(seconds)
        if plan is not None:  # a pass making progress keeps its daemon live, however long it runs
            self._heartbeat(plan, self._present())
        names = sorted(seconds)
        with self.engine.begin() as conn:
            theirs: set[str] = set()
            if plan is not None:
                self._assign(conn, plan)
                theirs = self._theirs()
            params = {  # each backend's lease said held; only those that hash here extended
                "holder": self.lease_holder,
                "backends": names,
                "seconds": [float(seconds[b]) for b in names],
                "renew": [b not in theirs for b in names],
                "within": min(within, 1e9),
            }
            return set(conn.execute(_RENEW, params).scalars())

    def _heartbeat(self, plan: Plan, presence: str | None) -> None:
        """Record this daemon as live (and prune the dead), in a transaction of its own: the claims of this
        daemon's passes hold its row's lock only for that, never while their own locks wait."""
        row = {"holder": self.lease_holder, "instance": self.instance, "presence": presence}
        with self.engine.begin() as conn:
            conn.execute(_HEARTBEAT, dict(row, lease_s=plan.live_s))
            conn.execute(_PRUNE, {"holder": self.lease_holder})

    def _assign(self, conn: Connection, plan: Plan) -> None:
        """Read the live set and assign the plan's backends over it (`_ours`, `_theirs`); the assignment
        is kept while the live set stays the same."""
        live = tuple(sorted(conn.execute(_LIVE).scalars()))
        key = (live, id(plan.weight))
        if self._assigned is None or self._assigned[0] != key:
            self._assigned = (key, assign(plan.weight, live))

    def _ours(self) -> list[str]:
        """The backends that hash here, sorted, by the last assignment computed."""
        if self._assigned is None:
            return []
        return sorted(b for b, d in self._assigned[1].items() if d == self.lease_holder)

    def _theirs(self) -> set[str]:
        """The backends that hash to another live daemon, by the last assignment computed."""
        if self._assigned is None:
            return set()
        return {b for b, d in self._assigned[1].items() if d != self.lease_holder}

    def fleet_view(self) -> tuple[str, ...]:
        """The live daemons at this daemon's last claim (itself alone before the first, or on SQLite)."""
        return self._assigned[0][0] if self._assigned else (self.lease_holder,)

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
        """End this process's leases (default: all of them, as it stops) so another daemon takes the
        backends over at their next pass rather than at the leases' expiry; how many ended.

        A stop leaves the fleet's live set, and marks its leases with its presence, which ends as the store
        closes: the others take them at this daemon's next pass, as from a killed one (deleted, they would
        be taken at once, and a backend this daemon has just probed would be probed again). A reload that
        removes backends deletes their leases: this daemon no longer probes them."""
        if not self.leased:
            return 0
        params: dict[str, object] = {"holder": self.lease_holder}
        with self.engine.begin() as conn:
            if backends is not None:
                sql = "DELETE FROM lease WHERE holder = :holder AND backend = ANY(CAST(:backends AS text[]))"
                return conn.execute(text(sql), dict(params, backends=list(backends))).rowcount
            conn.execute(text("DELETE FROM daemon WHERE holder = :holder"), params)
            sql = "UPDATE lease SET presence = :presence WHERE holder = :holder"
            return conn.execute(text(sql), dict(params, presence=presence_name(self.lease_holder))).rowcount
