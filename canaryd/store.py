"""The history: every run, observation, stack snapshot and baseline, in SQLite (or PostgreSQL).

Layout, chosen so that storage grows with change rather than with time:

* ``stack``: one row per distinct stack snapshot, keyed by its hash.
* ``payload``: token-level data (tokens, ids, bytes, logprobs, top-k) as zlib-compressed canonical JSON,
  keyed by content hash. JSON floats round-trip float64 exactly, so nothing is lost; an unchanged answer
  re-uses the existing row.
* ``observation``: one row per canary × backend × run, with the answer text, usage, fingerprint and the
  comparison against the baseline it was judged by, written in one transaction with its stack and payload.
* ``baseline``: the observation each canary × backend is compared against.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import JSON, Column, Index, LargeBinary, event
from sqlalchemy.engine import Engine
from sqlmodel import Field, Session, SQLModel, create_engine, select

from canaryd.compare import Comparison
from canaryd.observation import ErrorKind, Observation, TokenLogprob
from canaryd.stack import stack_hash as hash_of

PAYLOAD_FORMAT = 1


def utcnow() -> datetime:
    return datetime.now(UTC)


class RunRow(SQLModel, table=True):
    __tablename__ = "run"
    id: int | None = Field(default=None, primary_key=True)
    backend: str = Field(index=True)
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


class ObservationRow(SQLModel, table=True):
    __tablename__ = "observation"
    __table_args__ = (Index("ix_observation_backend_canary_id", "backend", "canary_id", "id"),)
    id: int | None = Field(default=None, primary_key=True)
    run_id: int = Field(foreign_key="run.id", index=True)
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
    system_fingerprint: str | None = None
    response_model: str | None = None
    headers: dict = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    stack_hash: str | None = Field(default=None, foreign_key="stack.hash")
    payload_hash: str | None = Field(default=None, foreign_key="payload.hash")
    error: str | None = None
    error_kind: str | None = None
    correct: bool | None = None
    verdict: str
    comparison: dict = Field(sa_column=Column(JSON, nullable=False))
    baseline_id: int | None = None


class BaselineRow(SQLModel, table=True):
    __tablename__ = "baseline"
    backend: str = Field(primary_key=True)
    canary_id: str = Field(primary_key=True)
    observation_id: int = Field(foreign_key="observation.id")
    accepted_at: datetime
    note: str = ""


def _encode_payload(tokens: list[TokenLogprob]) -> tuple[str, bytes]:
    doc = [
        [
            t.token,
            t.logprob,
            t.token_id,
            list(t.bytes) if t.bytes is not None else None,
            [list(x) for x in t.top],
        ]
        for t in tokens
    ]
    canonical = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
    return hashlib.sha256(canonical).hexdigest(), zlib.compress(canonical, 6)


def _decode_payload(data: bytes) -> list[TokenLogprob]:
    return [
        TokenLogprob(tok, lp, tid, tuple(b) if b is not None else None, tuple((t, v) for t, v in top))
        for tok, lp, tid, b, top in json.loads(zlib.decompress(data))
    ]


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")  # readers never block the prober
    cur.execute("PRAGMA synchronous=NORMAL")  # safe with WAL; a crash loses at most the last commit
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
    else:
        engine = create_engine(url, pool_pre_ping=True)
    SQLModel.metadata.create_all(engine)
    return engine


class Store:
    """All reads and writes of the history. One instance per process; thread-safe (a session per call)."""

    def __init__(self, url: str) -> None:
        self.engine = make_engine(url)

    @contextmanager
    def _session(self) -> Iterator[Session]:
        with Session(self.engine, expire_on_commit=False) as s:
            yield s

    def close(self) -> None:
        self.engine.dispose()

    # -- writes -------------------------------------------------------------------------------------
    def start_run(self, backend: str) -> int:
        with self._session() as s:
            run = RunRow(backend=backend, started_at=utcnow())
            s.add(run)
            s.commit()
            return run.id  # type: ignore[return-value]

    def finish_run(self, run_id: int, canaries: int) -> None:
        with self._session() as s:
            run = s.get(RunRow, run_id)
            if run is not None:
                run.finished_at, run.canaries = utcnow(), canaries
                s.add(run)
                s.commit()

    def add_observation(
        self, run_id: int, obs: Observation, comparison: Comparison, baseline_id: int | None
    ) -> int:
        """Write the observation, its stack and payload in one transaction; set the baseline if due."""
        with self._session() as s:
            stack_hash = None
            if obs.stack:
                stack_hash = hash_of(obs.stack)
                if s.get(StackRow, stack_hash) is None:
                    s.add(StackRow(hash=stack_hash, fields=obs.stack, first_seen=obs.started_at))
            payload_hash = None
            if obs.tokens:
                payload_hash, data = _encode_payload(obs.tokens)
                if s.get(PayloadRow, payload_hash) is None:
                    s.add(PayloadRow(hash=payload_hash, data=data))
            s.flush()
            row = ObservationRow(
                run_id=run_id,
                backend=obs.backend,
                canary_id=obs.canary_id,
                suite=obs.suite,
                started_at=obs.started_at,
                latency_s=obs.latency_s,
                request=obs.request,
                request_hash=obs.request_hash,
                text=obs.text,
                finish_reason=obs.finish_reason,
                prompt_tokens=obs.prompt_tokens,
                completion_tokens=obs.completion_tokens,
                system_fingerprint=obs.system_fingerprint,
                response_model=obs.response_model,
                headers=obs.headers,
                stack_hash=stack_hash,
                payload_hash=payload_hash,
                error=obs.error,
                error_kind=obs.error_kind.value if obs.error_kind else None,
                correct=comparison.correct,
                verdict=comparison.verdict.value,
                comparison=comparison.as_dict(),
                baseline_id=baseline_id,
            )
            s.add(row)
            s.flush()
            if comparison.verdict.value == "baseline":
                self._set_baseline(s, obs.backend, obs.canary_id, row.id, "first observation")  # type: ignore[arg-type]
            s.commit()
            return row.id  # type: ignore[return-value]

    @staticmethod
    def _set_baseline(s: Session, backend: str, canary_id: str, observation_id: int, note: str) -> None:
        row = s.get(BaselineRow, (backend, canary_id))
        if row is None:
            row = BaselineRow(
                backend=backend,
                canary_id=canary_id,
                observation_id=observation_id,
                accepted_at=utcnow(),
                note=note,
            )
        else:
            row.observation_id, row.accepted_at, row.note = observation_id, utcnow(), note
        s.add(row)

    def accept_latest(
        self, backend: str | None = None, canary_id: str | None = None
    ) -> list[tuple[str, str, int]]:
        """Make the latest successful observation of each canary × backend its baseline."""
        accepted = []
        with self._session() as s:
            q = select(ObservationRow).where(ObservationRow.error.is_(None))  # type: ignore[union-attr]
            if backend:
                q = q.where(ObservationRow.backend == backend)
            if canary_id:
                q = q.where(ObservationRow.canary_id == canary_id)
            latest: dict[tuple[str, str], ObservationRow] = {}
            for row in s.exec(q.order_by(ObservationRow.id)):  # type: ignore[arg-type]
                latest[(row.backend, row.canary_id)] = row
            for (b, c), row in sorted(latest.items()):
                self._set_baseline(s, b, c, row.id, "accepted")  # type: ignore[arg-type]
                accepted.append((b, c, row.id))
            s.commit()
        return accepted  # type: ignore[return-value]

    # -- reads --------------------------------------------------------------------------------------
    def baseline(self, backend: str, canary_id: str) -> tuple[int, Observation, bool | None] | None:
        """The baseline observation (with its id and correctness) for a canary × backend, if any."""
        with self._session() as s:
            b = s.get(BaselineRow, (backend, canary_id))
            if b is None:
                return None
            row = s.get(ObservationRow, b.observation_id)
            return (row.id, self._to_observation(s, row), row.correct) if row else None  # type: ignore[return-value]

    def observations(
        self, *, backend: str | None = None, canary_id: str | None = None, limit: int = 50
    ) -> list[ObservationRow]:
        with self._session() as s:
            q = select(ObservationRow)
            if backend:
                q = q.where(ObservationRow.backend == backend)
            if canary_id:
                q = q.where(ObservationRow.canary_id == canary_id)
            return list(s.exec(q.order_by(ObservationRow.id.desc()).limit(limit)))  # type: ignore[union-attr]

    def observation(self, obs_id: int) -> Observation | None:
        with self._session() as s:
            row = s.get(ObservationRow, obs_id)
            return self._to_observation(s, row) if row else None

    def stacks(self, backend: str | None = None) -> list[tuple[str, str, datetime, dict]]:
        """(backend, stack hash, first seen by that backend, fields), oldest first."""
        with self._session() as s:
            q = select(ObservationRow.backend, ObservationRow.stack_hash, ObservationRow.started_at).where(
                ObservationRow.stack_hash.is_not(None)  # type: ignore[union-attr]
            )
            if backend:
                q = q.where(ObservationRow.backend == backend)
            seen: dict[tuple[str, str], datetime] = {}
            for b, h, t in s.exec(q.order_by(ObservationRow.id)):  # type: ignore[arg-type]
                seen.setdefault((b, h), t)
            return [(b, h, t, s.get(StackRow, h).fields) for (b, h), t in seen.items()]  # type: ignore[union-attr]

    @staticmethod
    def _to_observation(s: Session, row: ObservationRow) -> Observation:
        payload = s.get(PayloadRow, row.payload_hash) if row.payload_hash else None
        stack = s.get(StackRow, row.stack_hash) if row.stack_hash else None
        return Observation(
            backend=row.backend,
            canary_id=row.canary_id,
            suite=row.suite,
            started_at=row.started_at,
            request=row.request,
            request_hash=row.request_hash,
            latency_s=row.latency_s,
            text=row.text,
            finish_reason=row.finish_reason,
            tokens=_decode_payload(payload.data) if payload else [],
            prompt_tokens=row.prompt_tokens,
            completion_tokens=row.completion_tokens,
            system_fingerprint=row.system_fingerprint,
            response_model=row.response_model,
            headers=row.headers,
            error=row.error,
            error_kind=ErrorKind(row.error_kind) if row.error_kind else None,
            stack=stack.fields if stack else {},
        )
