"""Shares of a fleet: which live daemon probes each backend, by weighted rendezvous hashing.

Every daemon of a fleet on one PostgreSQL database computes the same assignment from the same inputs (the
config's backends with their weights, the live daemons read from the database), so no coordinator is
needed. Each backend ranks the daemons by a hash of (daemon, backend), highest first (rendezvous, or
highest-random-weight, hashing): a daemon that joins or leaves moves only the backends it wins or held.
Plain rendezvous balances the *number* of backends only on average, and backends weigh differently (a
backend's weight is its canaries × passes per hour, `weights`), so the assignment is bounded: backends go
heaviest first to their best-ranked daemon whose load stays within a capacity of the average plus
`SLACK`, else to the least loaded one. Each daemon's load then ends within about one backend's weight of
an even share, and the assignment is a pure function of its inputs.

A daemon is hashed by its instance name (stable across restarts, so a restarted daemon gets its old share
back), its per-process token breaking the tie between two processes of one instance name.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

SLACK = 0.02  # the capacity over an even share: larger moves fewer backends on a join, balances worse


def weights(work: Mapping[str, Mapping[str, int]], interval_s: Mapping[str, float]) -> dict[str, float]:
    """Each backend's weight: canaries × passes per hour, summed over the schedules (``work``: schedule ->
    backend -> number of canaries the schedule sends it; ``interval_s``: schedule -> its interval)."""
    out: dict[str, float] = {}
    for schedule, per_backend in work.items():
        per_hour = 3600.0 / interval_s[schedule]
        for b, n in per_backend.items():
            out[b] = out.get(b, 0.0) + n * per_hour
    return out


def score(daemon: str, backend: str) -> int:
    """The rendezvous hash of a daemon (`canaryd.store.leases.holder_name`: instance#token) for a backend."""
    instance = daemon.rpartition("#")[0] or daemon
    return int.from_bytes(hashlib.blake2b(f"{instance}\0{backend}".encode(), digest_size=8).digest(), "big")


def assign(weight: Mapping[str, float], daemons: Iterable[str], slack: float = SLACK) -> dict[str, str]:
    """backend -> the daemon that probes it, among ``daemons`` (none: an empty assignment)."""
    live = sorted(set(daemons))
    if not live:
        return {}
    cap = sum(weight.values()) / len(live) * (1 + slack)
    load = dict.fromkeys(live, 0.0)
    out: dict[str, str] = {}
    for b in sorted(weight, key=lambda b: (-weight[b], b)):
        ranked = sorted(live, key=lambda d: (score(d, b), d), reverse=True)
        w = weight[b]
        d = next((d for d in ranked if load[d] + w <= cap), None)
        if d is None:  # nowhere within the capacity: the least loaded, ties to the better ranked
            d = min(ranked, key=lambda d: load[d])
        out[b] = d
        load[d] += w
    return out


def loads(assignment: Mapping[str, str], weight: Mapping[str, float]) -> dict[str, float]:
    """daemon -> the share of the total weight it was assigned (0 to 1)."""
    total = sum(weight.values()) or 1.0
    out: dict[str, float] = {}
    for b, d in assignment.items():
        out[d] = out.get(d, 0.0) + weight[b] / total
    return out
