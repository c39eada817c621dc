"""The fleet as the database sees it (`canaryd fleet`): each daemon's row, whether it is live, what it
holds. Read-only; the daemons write these rows as they claim (`canaryd.store.leases`)."""

from __future__ import annotations

from datetime import datetime
from typing import NamedTuple

from sqlalchemy import text

from canaryd.store.leases import _LIVE_WHERE, Leases

_MEMBERS = text(f"""
SELECT d.holder, d.instance, d.started, d.seen, extract(epoch FROM now() - d.seen), {_LIVE_WHERE},
       count(l.backend), coalesce(sum(l.weight), 0)
FROM daemon d LEFT JOIN lease l ON l.holder = d.holder AND l.expires > now()
GROUP BY d.holder ORDER BY d.instance, d.holder
""")
_TOTAL = text("SELECT count(*), coalesce(sum(weight), 0) FROM lease WHERE expires > now()")


class Member(NamedTuple):
    """A daemon of the fleet: ``live`` while its presence shows and its last pass (``last_pass``, its
    last claim) is within its lease; the backends whose leases it holds and their share of the weight."""

    holder: str
    instance: str
    started: datetime
    last_pass: datetime
    last_pass_ago_s: float
    live: bool
    backends: int
    share: float


def fleet(store: Leases) -> tuple[list[Member], int]:
    """The daemons with a row (live ones, and dead ones until pruned), and how many backends are leased."""
    with store.engine.connect() as conn:
        rows = conn.execute(_MEMBERS).all()
        leased, total = conn.execute(_TOTAL).one()
    total = float(total) or 1.0
    members = [
        Member(h, i, s, seen, float(ago), bool(live), int(n), float(w) / total)
        for h, i, s, seen, ago, live, n, w in rows
    ]
    return members, int(leased)
