"""What a probe pass reads of the store, held in memory between passes and re-read only when it changed.

Every probe is judged against its canary's baseline and calibration, which almost never change; reading
them row by row (five look-ups and a payload decode per probe) cost more than the probe. So a pass starts
with one *generation* query: aggregates of the ``baseline`` and ``calibration`` tables (row count, the sum
of their observation ids and timestamps) that any insert, replacement or delete moves, whichever process
made it (``baseline accept``, ``baseline calibrate``, another daemon of a fleet). Unchanged: the backend's
baselines and calibrations are those in memory, and the pass reads no row of them. Changed (or never
read): the backend's are loaded whole, in four statements (`canaryd.store.queries.Queries.judging`).

Content-addressed rows (stack, payload, request, outcome) are immutable, so the keys known to exist are kept
too (an outcome's with its row id, which its events refer to), and the writes skip their look-ups. A prune (by
any process) may delete one: the write that refers to it then fails its foreign key, and `Writes.record`
forgets the known keys and writes again with look-ups.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from sqlalchemy.engine import Connection

from canaryd.observation import Observation
from canaryd.store.records import Baseline, Reads, latest, latest_configuration

Generation = tuple
OUTCOMES_MAX = 100_000  # outcome ids kept (about 10 MB); more starts over

# One statement, read before anything it guards: a change committed after it is seen by the next pass.
_GENERATION = """
SELECT (SELECT count(*) FROM baseline), (SELECT sum(observation_id) FROM baseline),
       (SELECT sum({t}) FROM baseline), (SELECT count(*) FROM calibration),
       (SELECT sum({c}) FROM calibration)
"""
_SECONDS = {  # a timestamp as a number, so that its sum moves when any row's does
    "sqlite": ("julianday(accepted_at)", "julianday(created_at)"),
    "postgresql": ("extract(epoch from accepted_at)", "extract(epoch from created_at)"),
}


class Doc(dict):
    """A calibration's stored model as `Loaded` holds it between passes: `NoiseModel.from_dict` keeps what
    it parsed here, so each pass's four reads of it (first contact, judging, learning, the still-learning
    check) parse it once per generation. A stored model never changes in place: a new one is a new row."""

    __slots__ = ("parsed",)

    def __init__(self, doc: dict) -> None:
        super().__init__(doc)
        self.parsed = None


def generation(conn: Connection) -> Generation:
    """The generation of what `Loaded` holds: equal generations, equal baselines and calibrations."""
    t, c = _SECONDS.get(conn.dialect.name, ("0", "0"))
    return tuple(conn.exec_driver_sql(_GENERATION.format(t=t, c=c)).one())


Key = tuple[str, str]  # (canary id, serving configuration)


@dataclass
class Loaded:
    """One backend's baselines (observation, id, correctness) and calibrations, as of one generation, by
    canary and serving configuration."""

    baselines: dict[Key, Baseline]
    calibrations: dict[Key, dict]
    run_sets: dict[int, list[Observation]] = field(default_factory=dict)  # baseline sets, read on demand


class Cache:
    """The store's memory: each backend's `Loaded`, and the content keys known to exist. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._generation: Generation | None = None
        self._loaded: dict[str, Loaded] = {}
        self.known: set[str] = set()  # stack, payload and request hashes that exist (one key space: sha256)
        self.outcomes: dict[str, int] = {}  # outcome hash -> its row's id

    def current(self, backend: str, seen: Generation) -> Loaded | None:
        """The backend's `Loaded` if it is as of ``seen``; a new generation forgets every backend's."""
        with self._lock:
            if seen != self._generation:
                self._generation = seen
                self._loaded.clear()
            return self._loaded.get(backend)

    def keep(self, backend: str, seen: Generation, loaded: Loaded) -> None:
        """Hold ``loaded`` (read after ``seen`` was), unless a newer generation was seen meanwhile."""
        with self._lock:
            if seen == self._generation:
                self._loaded[backend] = loaded

    def learn(self, keys: Iterable[str], outcomes: dict[str, int] | None = None) -> None:
        with self._lock:
            self.known.update(keys)
            if outcomes:
                if len(self.outcomes) + len(outcomes) > OUTCOMES_MAX:  # answers that keep changing
                    self.outcomes = {}
                self.outcomes.update(outcomes)

    def forget(self) -> None:
        """Drop everything (a prune deleted rows, or a write found a known key gone)."""
        with self._lock:
            self._generation = None
            self._loaded.clear()
            self.known = set()
            self.outcomes = {}


_SHARED: dict[str, Cache] = {}
_SHARED_LOCK = threading.Lock()
_SHARED_MAX = 32


def shared(database: str) -> Cache:
    """The process's `Cache` of one database (its full URL): every `Store` on an equal URL shares it, so a
    store opened per pass (``canaryd check``, `canaryd.probe.run.one_pass`) starts with what the last one
    read and wrote, not from nothing. Sharing changes nothing it holds true: each pass still starts with the
    generation statement, and a known key another process pruned still fails its write, which forgets them.
    """
    with _SHARED_LOCK:
        cache = _SHARED.get(database)
        if cache is None:
            if len(_SHARED) >= _SHARED_MAX:  # many databases in one process (tests): start over
                _SHARED.clear()
            cache = _SHARED[database] = Cache()
        return cache


class Judging:
    """What a pass judges one backend's observations against: the store's `Reads`, answered from memory
    (a sampled baseline's run set is read once, then kept)."""

    def __init__(self, store: Reads, loaded: Loaded) -> None:
        self._store = store
        self._loaded = loaded

    def baseline(self, backend: str, canary_id: str, configuration: str | None = None) -> Baseline | None:
        """The configuration's baseline (None: the latest of any configuration)."""
        if configuration is None:
            return latest(self.baselines(backend, canary_id))
        return self._loaded.baselines.get((canary_id, configuration))

    def baselines(self, backend: str, canary_id: str) -> dict[str, Baseline]:
        """The canary's baseline under each configuration it has one for."""
        return {k: b for (c, k), b in self._loaded.baselines.items() if c == canary_id}

    def configurations(self, backend: str) -> set[str]:
        """The configurations any of the backend's canaries has a baseline under."""
        return {k for _, k in self._loaded.baselines}

    def calibration(self, backend: str, canary_id: str, configuration: str | None = None) -> dict | None:
        """The configuration's noise model (None: that of the latest baseline's configuration)."""
        if configuration is None:
            configuration = latest_configuration(self.baselines(backend, canary_id))
        return self._loaded.calibrations.get((canary_id, configuration or ""))

    def run_set(self, observation_id: int) -> list[Observation]:
        sets = self._loaded.run_sets
        if observation_id not in sets:
            sets[observation_id] = self._store.run_set(observation_id)
        return sets[observation_id]
