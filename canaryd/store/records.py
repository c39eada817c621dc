"""What the store hands out and what it takes in: plain data, no SQLAlchemy.

The table classes (``schema.py``) are bound to a session and to the schema of the day; a caller that held
one could lazy-load after its session closed, or break when a column moves between tables. So every read
returns one of the frozen records below, and the report, CLI and daemon code depend on these alone.

`Reads` names the store's read interface that judging goes through, whatever answers it.

The store also takes values from the judge (a comparison, a noise model, the detector's state) without
importing ``canaryd.judge``: the Protocols below say what it reads of them, so that the dependency points
one way (the judge may know the store's records; the store knows nothing of the judge).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Protocol, TypedDict

from canaryd.observation import Observation


def _json_time(t: datetime) -> str:
    """ISO 8601 as pydantic writes it (UTC as ``Z``): the form ``history --json`` always printed."""
    s = t.isoformat()
    return s[:-6] + "Z" if s.endswith("+00:00") else s


# -- what the store returns ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StoredObservation:
    """One stored observation's columns (the ``observation`` view), without its tokens or stack fields.

    `Store.load` pairs it with the full `Observation` where those are needed.
    """

    id: int
    run_id: int
    instance: str  # the canaryd instance that probed ("" for runs from before instances)
    backend: str
    canary_id: str
    suite: str
    started_at: datetime
    latency_s: float
    request: dict
    request_hash: str
    text: str | None
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    reasoning_tokens: int | None
    has_logprobs: bool | None  # None: written before revision 0005
    system_fingerprint: str | None
    response_model: str | None
    headers: dict
    stack_hash: str | None
    payload_hash: str | None
    error: str | None
    error_kind: str | None
    correct: bool | None
    verdict: str
    comparison: dict  # `Comparison.as_dict()` against its baseline
    baseline_id: int | None

    def as_dict(self) -> dict:
        """Every column, JSON-ready: what ``history --json`` prints and an ``export`` line starts from."""
        doc = {f.name: getattr(self, f.name) for f in fields(self)}
        doc["started_at"] = _json_time(self.started_at)
        return doc


@dataclass(frozen=True, slots=True)
class Baseline:
    """The observation a canary × backend is compared against, with whether it answered correctly."""

    observation_id: int
    observation: Observation
    correct: bool | None


def latest(baselines: dict[str, Baseline]) -> Baseline | None:
    """The most recent of several configurations' baselines (the highest observation id)."""
    return max(baselines.values(), key=lambda b: b.observation_id, default=None)


def latest_configuration(baselines: dict[str, Baseline]) -> str | None:
    """The configuration of the most recent of these baselines (None: there is none)."""
    if not baselines:
        return None
    return max(baselines.items(), key=lambda kv: kv[1].observation_id)[0]


class Reads(Protocol):
    """What an observation is judged against: the reads `canaryd.probe.shapes` makes, and a pass around it.

    `Store` answers them from the database (``queries``), ``Store.judging`` from the memory of a pass
    (``cache.Judging``), and a pass judging a replaced configuration narrows either to one baseline per
    canary (``canaryd.probe.run``)."""

    def baseline(self, backend: str, canary_id: str, configuration: str | None = None) -> Baseline | None:
        """The configuration's baseline (None: the latest of any configuration)."""
        ...

    def baselines(self, backend: str, canary_id: str) -> dict[str, Baseline]:
        """The canary's baseline under each configuration it has one for."""
        ...

    def configurations(self, backend: str) -> set[str]:
        """The configurations any of the backend's canaries has a baseline under."""
        ...

    def calibration(self, backend: str, canary_id: str, configuration: str | None = None) -> dict | None:
        """The configuration's noise model, ``NoiseModel.as_dict()`` (None: that of the latest baseline's
        configuration), None if uncalibrated."""
        ...

    def run_set(self, observation_id: int) -> list[Observation]:
        """Every observation of the same canary in the same run as this one (a sampled baseline's draws)."""
        ...


@dataclass(frozen=True, slots=True)
class RunInfo:
    """One pass of one backend by one canaryd instance."""

    id: int
    backend: str
    instance: str
    started_at: datetime
    finished_at: datetime | None  # None while the pass runs (or when it died)
    canaries: int


@dataclass(frozen=True, slots=True)
class StackSeen:
    """A distinct stack a backend showed, and when that backend first showed it."""

    backend: str
    hash: str
    first_seen: datetime
    fields: dict[str, str]

    def as_dict(self) -> dict:
        """JSON-ready, as ``canaryd stack --json`` prints it."""
        return {
            "backend": self.backend,
            "hash": self.hash,
            "first_seen": self.first_seen.isoformat(),
            "fields": self.fields,
        }


@dataclass(frozen=True, slots=True)
class RunStacks:
    """The distinct stacks one run's observations showed (several when a fleet answered it)."""

    run_id: int
    started_at: datetime
    stacks: tuple[dict[str, str], ...]  # ordered by stack hash


@dataclass(frozen=True, slots=True)
class Accepted:
    """A baseline `Store.accept_latest` set."""

    backend: str
    canary_id: str
    observation_id: int
    configuration: str = field(default="", compare=False)  # the serving configuration it is the baseline of


# -- what the store takes from the judge --------------------------------------------------------------


class ComparisonLike(Protocol):
    """What `Store.add_observation` stores of a judgement (``canaryd.judge.compare.Comparison``)."""

    @property
    def verdict(self) -> enum.StrEnum: ...

    @property
    def correct(self) -> bool | None: ...

    def as_dict(self) -> dict: ...


class NoiseModelLike(Protocol):
    """What `Store.save_calibration` stores of a noise model (``canaryd.judge.stats.NoiseModel``).

    `Store.calibration` gives back ``as_dict()``; ``NoiseModel.from_dict`` rebuilds the model from it.
    """

    @property
    def request_hash(self) -> str: ...

    @property
    def k(self) -> int: ...

    @property
    def regime(self) -> enum.StrEnum: ...

    def summary(self) -> dict: ...

    def as_dict(self) -> dict: ...


class DetectorDoc(TypedDict):
    """A backend's e-CUSUM as `Store.fold_detector` passes it (``DetectorState.as_dict``/``from_dict``)."""

    statistic: float
    cycles: int
    alarm: bool
    pending: list[str]  # exact-regime canaries that moved last cycle


def detector_start() -> DetectorDoc:
    """A backend's detector before its first cycle (and after a calibration restarts it): as
    ``DetectorState()``, which tests/unit/test_store.py checks."""
    return {"statistic": 1.0, "cycles": 0, "alarm": False, "pending": []}


@dataclass(frozen=True, slots=True)
class EvalSession:
    """An evaluation run under canaryd (``canaryd.api.Session``, ``preflight``): what ran between the runs
    that checked the stack before and after, and which serving configurations answered its samples."""

    id: int
    started_at: datetime
    finished_at: datetime | None
    harness: str
    task: str
    samples: int
    configurations: dict[str, int]  # serving configuration ("" when unnamed) → samples it answered
    runs_before: tuple[int, ...]
    runs_after: tuple[int, ...]
    held: bool | None
    out_dir: str

    def as_dict(self) -> dict:
        doc = {f.name: getattr(self, f.name) for f in fields(self)}
        doc["started_at"] = _json_time(self.started_at)
        doc["finished_at"] = None if self.finished_at is None else _json_time(self.finished_at)
        doc["runs_before"], doc["runs_after"] = list(self.runs_before), list(self.runs_after)
        return doc
