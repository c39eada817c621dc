"""The history: every run, observation, stack snapshot and baseline, in SQLite (or PostgreSQL).

The package, by role (dependencies point down this list, and never into ``canaryd.judge``):

* ``records``: the plain frozen records the store returns, and the Protocols of what it takes in;
* ``schema``: the tables (SQLModel) and the encoding of token payloads: the store's own business;
* ``engine``: connecting, SQLite pragmas, and the Alembic migrations every `Store` runs first;
* ``writes`` and ``queries``: the two halves of `Store`, composed here.

Fleets: several daemons (distinct instance names) may write one PostgreSQL database at once; see
``writes`` for how content-addressed rows and shared baselines stay consistent.
"""

from __future__ import annotations

import socket
import threading

import structlog

from canaryd.store.engine import label, make_engine, migrate
from canaryd.store.queries import Queries
from canaryd.store.records import (
    Accepted,
    Baseline,
    ComparisonLike,
    DetectorDoc,
    NoiseModelLike,
    RunInfo,
    RunStacks,
    StackSeen,
    StoredObservation,
)
from canaryd.store.writes import Writes

__all__ = [
    "Accepted",
    "Baseline",
    "ComparisonLike",
    "DetectorDoc",
    "NoiseModelLike",
    "RunInfo",
    "RunStacks",
    "StackSeen",
    "Store",
    "StoredObservation",
]

log = structlog.get_logger("canaryd.store")


class Store(Writes, Queries):
    """All reads and writes of the history. One instance per process; thread-safe (a session per call).

    Several processes may share one database (a fleet of daemons on PostgreSQL, or the daemon and the CLI on
    SQLite): content-addressed rows are inserted idempotently, every run records the ``instance`` that
    probed, and baselines are shared: one baseline per backend × canary for the whole fleet.
    """

    def __init__(self, url: str, instance: str | None = None) -> None:
        self.instance = instance or socket.gethostname()
        self._detector_lock = threading.Lock()
        self.engine = make_engine(url)
        try:
            before, after = migrate(self.engine)
        except BaseException:
            self.engine.dispose()
            raise
        if before != after:
            log.info("schema_migrated", database=label(self.engine), before=before, after=after)

    @property
    def url(self) -> str:
        """The database URL without credentials: safe to print in a record."""
        return self.engine.url.set(username=None, password=None).render_as_string(hide_password=False)

    def close(self) -> None:
        self.engine.dispose()
