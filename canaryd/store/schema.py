"""The history's tables, as SQLModel classes, and how token payloads are encoded in them.

These classes describe the schema the Alembic migrations build (``canaryd/store/migrations``); they are
the store's own business. Nothing outside ``canaryd.store`` reads them: the store hands out the plain
records of ``canaryd.store.records`` instead (tests of the schema itself excepted).

Layout, chosen so that storage grows with change rather than with time:

* ``run``: one pass of one backend by one canaryd ``instance`` (the daemon's name, default the hostname).
* ``stack``: one row per distinct stack snapshot, keyed by its hash.
* ``payload``: token-level data (tokens, ids, bytes, logprobs, top-k) as zlib-compressed canonical JSON,
  keyed by content hash. JSON floats round-trip float64 exactly, so nothing is lost; an unchanged answer
  re-uses the existing row.
* ``request``: the exact request body sent, keyed by content hash (a canary's request rarely changes).
* ``outcome``: what an observation saw and how it was judged (text, usage, fingerprint, stack, payload,
  verdict, the comparison with its baseline), keyed by content hash: an identical repeat re-uses it.
* ``event``: one thin row per canary × backend × probe: run, time, latency, per-request headers, the
  latency's calibrated evidence (a value of this probe alone, so it would make every outcome new) and its
  outcome. This is all an unchanged probe costs (about 100 bytes; see ``bench/storage_bench.py``).
* ``observation``: a view over event ⋈ outcome ⋈ request ⋈ run, with the columns one observation always had
  (and the probing instance); reads go here.
* ``baseline``: the observation each canary × backend × serving configuration is compared against.
* ``keep``: observations a pin, preflight or record refers to; ``prune`` never deletes them.
* ``calibration``: the noise model ``baseline calibrate`` learned per backend × canary × configuration.
* ``detector``: each backend's e-CUSUM statistic and alarm, carried across cycles and restarts.
* ``lease``: which daemon of a PostgreSQL fleet runs each backend's schedules, until when (``leases``).
* ``daemon``: the daemons of a PostgreSQL fleet, with their presence and last claim (``leases``).
* ``eval_session``: an evaluation run under canaryd (`canaryd.api.Session`, ``preflight``): the harness,
  task and samples, the serving configurations that answered them, and the runs before and after.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from datetime import datetime

from sqlalchemy import JSON, Column, Index, LargeBinary
from sqlmodel import Field, SQLModel

from canaryd.observation import TokenLogprob

PAYLOAD_FORMAT = 1  # the layout `compress_payload` writes; stored per row so that a new one can coexist


class RunRow(SQLModel, table=True):
    """One pass of one backend, by one canaryd instance (several daemons can share a database)."""

    __tablename__ = "run"
    id: int | None = Field(default=None, primary_key=True)
    backend: str = Field(index=True)
    # Which daemon probed (`[daemon] instance`, default the hostname); "" for runs from before 0002.
    instance: str = Field(default="", sa_column_kwargs={"server_default": ""})
    started_at: datetime
    finished_at: datetime | None = None
    canaries: int = 0


class StackRow(SQLModel, table=True):
    __tablename__ = "stack"
    hash: str = Field(primary_key=True)
    fields: dict = Field(sa_column=Column(JSON, nullable=False))
    first_seen: datetime


class PayloadRow(SQLModel, table=True):
    __tablename__ = "payload"
    hash: str = Field(primary_key=True)
    format: int = PAYLOAD_FORMAT
    data: bytes = Field(sa_column=Column(LargeBinary, nullable=False))


class RequestRow(SQLModel, table=True):
    __tablename__ = "request"
    hash: str = Field(primary_key=True)
    body: dict = Field(sa_column=Column(JSON, nullable=False))


class OutcomeRow(SQLModel, table=True):
    """Everything about an observation that an identical repeat repeats; stored once per content hash."""

    __tablename__ = "outcome"
    __table_args__ = (Index("ix_outcome_backend_canary_id", "backend", "canary_id"),)
    id: int | None = Field(default=None, primary_key=True)
    hash: str = Field(unique=True)
    backend: str
    canary_id: str
    suite: str
    request_ref: str = Field(foreign_key="request.hash")
    request_hash: str  # the backend's own hash of the request (baselines are per request)
    text: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    reasoning_tokens: int | None = None
    has_logprobs: bool | None = None  # None: written before revision 0005 (logprobs iff a payload)
    system_fingerprint: str | None = None
    response_model: str | None = None
    stack_hash: str | None = Field(default=None, foreign_key="stack.hash")
    payload_hash: str | None = Field(default=None, foreign_key="payload.hash")
    error: str | None = None
    error_kind: str | None = None
    correct: bool | None = None
    verdict: str
    comparison: dict = Field(sa_column=Column(JSON, nullable=False))
    baseline_id: int | None = None


class EventRow(SQLModel, table=True):
    """One probe: what differs even between identical observations (time, latency, request headers)."""

    __tablename__ = "event"
    id: int | None = Field(default=None, primary_key=True)
    run_id: int = Field(foreign_key="run.id", index=True)
    outcome_id: int = Field(foreign_key="outcome.id", index=True)
    started_at: datetime
    latency_s: float
    headers: dict = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    # the comparison's ``latency`` (`Evidence.as_dict`), kept out of the outcome since 0009; NULL: none,
    # or written before 0009 (the outcome's comparison holds it)
    latency_evidence: dict | None = Field(default=None, sa_column=Column(JSON, nullable=True))


class ObservationRow(SQLModel, table=True):
    """One observation as it reads: a view over event ⋈ outcome ⋈ request ⋈ run (never written directly).

    The view's SQL lives in the migrations (``migrations/versions``); tests/unit/test_migrations.py checks
    that its columns are these, and tests/unit/test_store.py that `records.StoredObservation` has them.
    """

    __tablename__ = "observation"
    id: int | None = Field(default=None, primary_key=True)
    run_id: int
    instance: str
    backend: str
    canary_id: str
    suite: str
    started_at: datetime
    latency_s: float
    request: dict = Field(sa_column=Column(JSON, nullable=False))
    request_hash: str
    text: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    reasoning_tokens: int | None = None
    has_logprobs: bool | None = None  # None: written before revision 0005 (logprobs iff a payload)
    system_fingerprint: str | None = None
    response_model: str | None = None
    headers: dict = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    stack_hash: str | None = None
    payload_hash: str | None = None
    error: str | None = None
    error_kind: str | None = None
    correct: bool | None = None
    verdict: str
    comparison: dict = Field(sa_column=Column(JSON, nullable=False))
    baseline_id: int | None = None
    latency_evidence: dict | None = Field(default=None, sa_column=Column(JSON, nullable=True))  # of the event


class BaselineRow(SQLModel, table=True):
    __tablename__ = "baseline"
    backend: str = Field(primary_key=True)
    canary_id: str = Field(primary_key=True)
    # `canaryd.stack.configuration_of` the baseline's stack ("" when it names none)
    configuration: str = Field(default="", primary_key=True, sa_column_kwargs={"server_default": ""})
    observation_id: int = Field(foreign_key="event.id")
    accepted_at: datetime
    note: str = ""


class KeepRow(SQLModel, table=True):
    """An observation something outside the store points at (a pin, a preflight, a record): never pruned."""

    __tablename__ = "keep"
    observation_id: int = Field(primary_key=True, foreign_key="event.id")
    reason: str = Field(primary_key=True)  # pin, preflight, record
    at: datetime


class EvalSessionRow(SQLModel, table=True):
    """An evaluation session: what a harness ran between the runs that checked the stack before and after."""

    __tablename__ = "eval_session"
    id: int | None = Field(default=None, primary_key=True)
    started_at: datetime
    finished_at: datetime | None = None
    harness: str = ""  # inspect, lm-eval, a command's argv[0], or what the caller names
    task: str = ""
    samples: int = 0
    configurations: dict = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))  # id → n
    runs_before: list = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    runs_after: list = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    held: bool | None = None  # the stack and canaries held to the end (None: not checked after)
    out_dir: str = ""


class CalibrationRow(SQLModel, table=True):
    """The calibrated noise model of one canary × backend (replaced by each ``baseline calibrate``)."""

    __tablename__ = "calibration"
    backend: str = Field(primary_key=True)
    canary_id: str = Field(primary_key=True)
    configuration: str = Field(default="", primary_key=True, sa_column_kwargs={"server_default": ""})
    request_hash: str  # the request it was learned for; another request ignores it
    created_at: datetime
    k: int
    regime: str
    summary: dict = Field(sa_column=Column(JSON, nullable=False))
    model: dict = Field(sa_column=Column(JSON, nullable=False))


class DetectorRow(SQLModel, table=True):
    """One backend's sequential detector (see ``canaryd.judge.compare.decide``)."""

    __tablename__ = "detector"
    backend: str = Field(primary_key=True)
    statistic: float
    cycles: int
    alarm: bool
    pending: list = Field(sa_column=Column(JSON, nullable=False))
    updated_at: datetime


class LeaseRow(SQLModel, table=True):
    """Which daemon process runs a backend's schedules, until ``expires`` (the database's clock)."""

    __tablename__ = "lease"
    backend: str = Field(primary_key=True)
    holder: str  # `canaryd.store.leases.Leases.lease_holder`: instance name and a per-process token
    expires: datetime
    presence: str | None = None  # the holder's presence connection (`leases.presence_name`), when visible
    weight: float | None = None  # the backend's canaries × passes per hour (`canaryd.shares.weights`)
    probed: datetime | None = None  # when the holder last set out to probe it (`leases.start_probes`)


class DaemonRow(SQLModel, table=True):
    """A daemon of a fleet: live while its presence shows and its last claim (``seen``) is within
    ``lease_s`` (its shortest lease), on the database's clock."""

    __tablename__ = "daemon"
    holder: str = Field(primary_key=True)  # `canaryd.store.leases.holder_name`
    instance: str
    presence: str | None = None
    started: datetime
    seen: datetime
    lease_s: float


def compress_payload(canonical: bytes) -> bytes:
    return zlib.compress(canonical, 6)


_CANONICAL = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, check_circular=False).encode


def payload_key(tokens: list[TokenLogprob]) -> tuple[str, bytes]:
    """(content hash, canonical JSON) of an answer's tokens: the key alone tells whether the row exists,
    so a repeated answer is never compressed again."""
    # tuples encode as the lists they were once copied into, so the text (and the key) is the same
    doc = [
        (
            t.token,
            t.logprob,
            t.token_id,
            t.bytes if type(t.bytes) in (tuple, type(None)) else list(t.bytes),
            t.top,
        )
        for t in tokens
    ]
    canonical = _CANONICAL(doc).encode()
    return hashlib.sha256(canonical).hexdigest(), canonical


def decode_payload(data: bytes) -> list[TokenLogprob]:
    """The tokens `compress_payload` stored, exactly (JSON floats round-trip float64)."""
    return [
        TokenLogprob(tok, lp, tid, tuple(b) if b is not None else None, tuple((t, v) for t, v in top))
        for tok, lp, tid, b, top in json.loads(zlib.decompress(data))
    ]
