"""The history: every run, observation, stack snapshot and baseline, in SQLite (or PostgreSQL).

The package, by role (dependencies point down this list, and never into ``canaryd.judge``):

* ``records``: the plain frozen records the store returns, the Protocols of what it takes in, and `Reads`,
  the read interface judging goes through;
* ``schema``: the tables (SQLModel) and the encoding of token payloads: the store's own business;
* ``cache``: what passes read, held in memory between them;
* ``engine``: connecting, SQLite pragmas, and the Alembic migrations every `Store` runs first;
* ``baselines`` (what judging reads: baselines, keeps, noise models, the detector), ``writes`` (runs and
  observations), ``maintenance`` (retention) and ``queries`` (the reads): the parts of `Store`, composed
  here.

Fleets: several daemons (distinct instance names) may write one PostgreSQL database at once; see
``writes`` for how content-addressed rows stay consistent, ``baselines`` for shared baselines, and
``leases`` for how they share the probing.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from canaryd.errors import InputError
from canaryd.store.baselines import Baselines
from canaryd.store.cache import Cache, shared
from canaryd.store.engine import StorageUnusable, label, make_engine, migrate
from canaryd.store.leases import Leases, holder_name, lease_seconds
from canaryd.store.maintenance import Maintenance
from canaryd.store.queries import Queries
from canaryd.store.records import (
    Accepted,
    Baseline,
    ComparisonLike,
    DetectorDoc,
    EvalSession,
    NoiseModelLike,
    Reads,
    RunInfo,
    RunStacks,
    StackSeen,
    StoredObservation,
)
from canaryd.store.sessions import Sessions
from canaryd.store.writes import Writes

__all__ = [
    "Accepted",
    "Baseline",
    "ComparisonLike",
    "DetectorDoc",
    "EvalSession",
    "NoiseModelLike",
    "Reads",
    "RunInfo",
    "RunStacks",
    "StackSeen",
    "Store",
    "StoredObservation",
    "existing_revision",
    "lease_seconds",
    "naming_storage",
    "open_store",
]

if TYPE_CHECKING:
    from canaryd.config import Config

log = structlog.get_logger("canaryd.store")


class Store(Writes, Baselines, Maintenance, Queries, Leases, Sessions):
    """All reads and writes of the history. One instance per process; thread-safe (a session per call).

    Several processes may share one database (a fleet of daemons on PostgreSQL, or the daemon and the CLI on
    SQLite): content-addressed rows are inserted idempotently, every run records the ``instance`` that
    probed, and baselines are shared: one baseline per backend × canary for the whole fleet; on PostgreSQL,
    leases (``leases``) give each backend to one live daemon of the fleet.
    """

    def __init__(self, url: str, instance: str | None = None) -> None:
        self.instance = instance or socket.gethostname()
        self.lease_holder = holder_name(self.instance)
        self._detector_lock = threading.Lock()
        self._presence_lock = threading.Lock()
        self.engine = make_engine(url)
        url_ = self.engine.url
        memory = url_.get_backend_name() == "sqlite" and (
            url_.database in (None, "", ":memory:") or "memory" in str(url_.query) + (url_.database or "")
        )  # each in-memory database is its own, whatever its URL: nothing to share
        self._cache = Cache() if memory else shared(url_.render_as_string(hide_password=False))
        try:
            before, after = migrate(self.engine)
        except BaseException:
            self.engine.dispose()
            raise
        if before != after:
            log.info("schema_migrated", database=label(self.engine), before=before, after=after)

    @property
    def url(self) -> str:
        """The database URL without credentials (user, password, query parameters such as ``password=``):
        safe to print in a record or a report."""
        return self.engine.url.set(username=None, password=None, query={}).render_as_string(
            hide_password=False
        )

    def close(self) -> None:
        self.end_presence()
        self.engine.dispose()


@contextmanager
def naming_storage(config: Config) -> Iterator[None]:
    """A database the config points at that cannot be used becomes an `InputError` naming its key:
    ``state_dir`` (the default SQLite file) or ``storage.url``."""
    try:
        yield
    except StorageUnusable as e:
        if config.storage.url is None:
            what = "" if e.path in (None, config.state_dir) else f" {e.path}"
            where = f"{config.path}: state_dir {config.state_dir}"
            raise InputError(f"{where}: cannot create{what}: {e.why}") from None
        raise InputError(f"{config.path}: storage.url {_masked(config.storage.url)}: unusable: {e}") from None


def open_store(config: Config) -> Store:
    """The config's history database, open and migrated (a config problem is an `InputError`, exit 2)."""
    with naming_storage(config):
        return Store(config.storage_url, instance=config.daemon.instance)


def upgrade_database(config: Config) -> tuple[str, str | None, str]:
    """`canaryd db upgrade`: (the database without credentials, revision before, revision after)."""
    from canaryd.store.engine import upgrade

    with naming_storage(config):
        return upgrade(config.storage_url)


def database_revision(config: Config) -> str | None:
    """`canaryd db current`: the database's revision (None: empty), changing nothing."""
    from canaryd.store.engine import revision

    with naming_storage(config):
        return revision(config.storage_url)


def existing_revision(config: Config) -> str | None:
    """The revision of the database the config names (None: no schema), for commands that only read: a
    SQLite file that does not exist is an `InputError` naming the key, and nothing is created."""
    from sqlalchemy.engine import make_url

    from canaryd.store.engine import revision

    with naming_storage(config):
        url = make_url(config.storage_url)
        db = url.database or ""
        if url.get_backend_name() == "sqlite" and db not in ("", ":memory:") and not db.startswith("file:"):
            path = Path(db).expanduser()
            if not path.is_file():
                key = "storage.url" if config.storage.url is not None else f"state_dir {config.state_dir}"
                raise InputError(f"{config.path}: {key}: no history database at {path} (nothing probed yet?)")
        return revision(config.storage_url)


def _masked(url: str) -> str:
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url
