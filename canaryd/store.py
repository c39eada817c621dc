"""The history: every run, observation, stack snapshot and baseline, in SQLite (or PostgreSQL).

Layout, chosen so that storage grows with change rather than with time:

* ``stack``: one row per distinct stack snapshot, keyed by its hash.
* ``payload``: token-level data (tokens, ids, bytes, logprobs, top-k) as zlib-compressed canonical JSON,
  keyed by content hash. JSON floats round-trip float64 exactly, so nothing is lost; an unchanged answer
  re-uses the existing row.
* ``request``: the exact request body sent, keyed by content hash (a canary's request rarely changes).
* ``outcome``: what an observation saw and how it was judged (text, usage, fingerprint, stack, payload,
  verdict, the comparison with its baseline), keyed by content hash: an identical repeat re-uses it.
* ``event``: one thin row per canary × backend × probe: run, time, latency, per-request headers and its
  outcome. This is all an unchanged probe costs (about 100 bytes; see ``bench/storage_bench.py``).
* ``observation``: a view joining the three, with the columns one observation always had; reads go here.
* ``baseline``: the observation each canary × backend is compared against.
* ``keep``: observations a pin, preflight or record refers to; ``prune`` never deletes them.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import JSON, Column, Index, LargeBinary, delete, event, inspect, or_, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlmodel import Field, Session, SQLModel, col, create_engine, select

from canaryd.compare import Comparison
from canaryd.observation import ErrorKind, Observation, TokenLogprob
from canaryd.stack import stack_hash as hash_of

PAYLOAD_FORMAT = 1


class SchemaMismatch(SQLAlchemyError):
    """The database was written by an older canaryd; there are no migrations yet (exit 4, one line)."""


def utcnow() -> datetime:
    return datetime.now(UTC)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _canonical(doc: object) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str).encode()


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


class ObservationRow(SQLModel, table=True):
    """One observation as it reads: a view over event ⋈ outcome ⋈ request (never written directly)."""

    __tablename__ = "observation"
    id: int | None = Field(default=None, primary_key=True)
    run_id: int
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
    stack_hash: str | None = None
    payload_hash: str | None = None
    error: str | None = None
    error_kind: str | None = None
    correct: bool | None = None
    verdict: str
    comparison: dict = Field(sa_column=Column(JSON, nullable=False))
    baseline_id: int | None = None


OBSERVATION_VIEW = """
SELECT e.id AS id, e.run_id AS run_id, o.backend AS backend, o.canary_id AS canary_id, o.suite AS suite,
       e.started_at AS started_at, e.latency_s AS latency_s, r.body AS request,
       o.request_hash AS request_hash,
       o.text AS text, o.finish_reason AS finish_reason, o.prompt_tokens AS prompt_tokens,
       o.completion_tokens AS completion_tokens, o.system_fingerprint AS system_fingerprint,
       o.response_model AS response_model, e.headers AS headers, o.stack_hash AS stack_hash,
       o.payload_hash AS payload_hash, o.error AS error, o.error_kind AS error_kind, o.correct AS correct,
       o.verdict AS verdict, o.comparison AS comparison, o.baseline_id AS baseline_id
FROM event e JOIN outcome o ON o.id = e.outcome_id JOIN request r ON r.hash = o.request_ref
"""


class BaselineRow(SQLModel, table=True):
    __tablename__ = "baseline"
    backend: str = Field(primary_key=True)
    canary_id: str = Field(primary_key=True)
    observation_id: int = Field(foreign_key="event.id")
    accepted_at: datetime
    note: str = ""


class KeepRow(SQLModel, table=True):
    """An observation something outside the store points at (a pin, a preflight, a record): never pruned."""

    __tablename__ = "keep"
    observation_id: int = Field(primary_key=True, foreign_key="event.id")
    reason: str = Field(primary_key=True)  # pin, preflight, record
    at: datetime


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
        path = Path(url.removeprefix("sqlite:///").split("?")[0]).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        # Wait up to 30 s for another writer's lock (Python's default is 5 s); `?timeout=N` in the URL wins.
        engine = create_engine(url, connect_args={} if "timeout=" in url else {"timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
    else:
        engine = create_engine(url, pool_pre_ping=True)
    if "observation" in inspect(engine).get_table_names():
        raise SchemaMismatch(
            f"{engine.url.render_as_string()}: written by an older canaryd (observation is a table, now a "
            "view); there are no migrations yet: move the database aside"
        )
    tables = [t for t in SQLModel.metadata.sorted_tables if t.name != "observation"]
    SQLModel.metadata.create_all(engine, tables=tables)
    create = "CREATE VIEW IF NOT EXISTS" if engine.dialect.name == "sqlite" else "CREATE OR REPLACE VIEW"
    with engine.begin() as conn:
        conn.exec_driver_sql(f"{create} observation AS {OBSERVATION_VIEW}")
    return engine


class Store:
    """All reads and writes of the history. One instance per process; thread-safe (a session per call)."""

    def __init__(self, url: str) -> None:
        self.engine = make_engine(url)

    @property
    def url(self) -> str:
        """The database URL without credentials: safe to print in a record."""
        return self.engine.url.set(username=None, password=None).render_as_string(hide_password=False)

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
        """Write the observation in one transaction; what it shares with earlier ones is stored once.

        The stack, payload, request and outcome are content-addressed, so an identical repeat adds one
        ``event`` row (time, latency, headers) and nothing else.
        """
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
            request_ref = _digest(_canonical(obs.request))
            if s.get(RequestRow, request_ref) is None:
                s.add(RequestRow(hash=request_ref, body=obs.request))
            fields = {
                "backend": obs.backend,
                "canary_id": obs.canary_id,
                "suite": obs.suite,
                "request_ref": request_ref,
                "request_hash": obs.request_hash,
                "text": obs.text,
                "finish_reason": obs.finish_reason,
                "prompt_tokens": obs.prompt_tokens,
                "completion_tokens": obs.completion_tokens,
                "system_fingerprint": obs.system_fingerprint,
                "response_model": obs.response_model,
                "stack_hash": stack_hash,
                "payload_hash": payload_hash,
                "error": obs.error,
                "error_kind": obs.error_kind.value if obs.error_kind else None,
                "correct": comparison.correct,
                "verdict": comparison.verdict.value,
                "comparison": comparison.as_dict(),
                "baseline_id": baseline_id,
            }
            outcome_hash = _digest(_canonical(fields))
            outcome_id = s.exec(select(OutcomeRow.id).where(OutcomeRow.hash == outcome_hash)).first()
            if outcome_id is None:
                outcome = OutcomeRow(hash=outcome_hash, **fields)
                s.add(outcome)
                s.flush()
                outcome_id = outcome.id
            row = EventRow(
                run_id=run_id,
                outcome_id=outcome_id,  # type: ignore[arg-type]
                started_at=obs.started_at,
                latency_s=obs.latency_s,
                headers=obs.headers,
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

    def keep(self, observation_ids: Sequence[int], reason: str) -> None:
        """Mark observations as referenced from outside the store (a pin, preflight or record)."""
        with self._session() as s:
            for oid in set(observation_ids):
                if s.get(KeepRow, (oid, reason)) is None:
                    s.add(KeepRow(observation_id=oid, reason=reason, at=utcnow()))
            s.commit()

    def prune(self, cutoff: datetime, *, dry_run: bool = False) -> dict[str, int]:
        """Delete observations started before ``cutoff``, then what only they used; counts per table.

        Never deleted: current baselines, kept observations, and the baselines that any surviving
        observation was judged against (its comparison names them). A dry run deletes inside a
        transaction and rolls it back, so its counts are exactly what a real run would delete.
        """
        survives = or_(
            col(EventRow.started_at) >= cutoff,
            col(EventRow.id).in_(select(BaselineRow.observation_id)),
            col(EventRow.id).in_(select(KeepRow.observation_id)),
        )
        judged_against = (
            select(OutcomeRow.baseline_id)
            .join(EventRow, col(EventRow.outcome_id) == OutcomeRow.id)
            .where(survives, col(OutcomeRow.baseline_id).is_not(None))
        )
        used = {
            "outcome": select(EventRow.outcome_id),
            "payload": select(OutcomeRow.payload_hash).where(col(OutcomeRow.payload_hash).is_not(None)),
            "stack": select(OutcomeRow.stack_hash).where(col(OutcomeRow.stack_hash).is_not(None)),
            "request": select(OutcomeRow.request_ref),
        }
        counts: dict[str, int] = {}
        with self._session() as s:
            doomed = select(EventRow.id).where(~survives, col(EventRow.id).not_in(judged_against))
            counts["observation"] = s.exec(delete(EventRow).where(col(EventRow.id).in_(doomed))).rowcount  # type: ignore[call-overload]
            for table, key in (
                (OutcomeRow, OutcomeRow.id),
                (PayloadRow, PayloadRow.hash),
                (StackRow, StackRow.hash),
                (RequestRow, RequestRow.hash),
            ):
                stmt = delete(table).where(col(key).not_in(used[table.__tablename__]))  # type: ignore[attr-defined]
                counts[table.__tablename__] = s.exec(stmt).rowcount  # type: ignore[call-overload,attr-defined]
            empty_run = (col(RunRow.started_at) < cutoff) & col(RunRow.id).not_in(select(EventRow.run_id))
            counts["run"] = s.exec(delete(RunRow).where(empty_run)).rowcount  # type: ignore[call-overload]
            if dry_run:
                s.rollback()
            else:
                s.commit()
        if not dry_run and self.engine.dialect.name == "sqlite":
            with self.engine.connect() as conn:  # fold the WAL into the database file and truncate it
                conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
        return counts

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

    def load(self, ids: Sequence[int]) -> list[tuple[ObservationRow, Observation]]:
        """Observations by id, as stored rows and full observations (tokens, stack), in id order."""
        with self._session() as s:
            rows = s.exec(select(ObservationRow).where(col(ObservationRow.id).in_(ids)).order_by(text("id")))
            return [(row, self._to_observation(s, row)) for row in rows]

    def run_ids(self, since: datetime) -> list[int]:
        """Runs started at or after ``since``, oldest first."""
        with self._session() as s:
            q = select(RunRow.id).where(RunRow.started_at >= since).order_by(text("id"))
            return list(s.exec(q))  # type: ignore[arg-type]

    def ids_of_runs(self, run_ids: Sequence[int]) -> list[int]:
        with self._session() as s:
            q = select(EventRow.id).where(col(EventRow.run_id).in_(run_ids)).order_by(text("id"))
            return list(s.exec(q))  # type: ignore[arg-type]

    def canaries(self, backend: str) -> list[str]:
        """Every canary this backend was ever probed with, sorted."""
        with self._session() as s:
            q = select(OutcomeRow.canary_id).where(OutcomeRow.backend == backend).distinct()
            return sorted(s.exec(q))

    def verdicts(self, backend: str, canary_id: str) -> Iterator[tuple[int, str]]:
        """(observation id, verdict) of one canary × backend, newest first, streamed."""
        with self._session() as s:
            q = (
                select(ObservationRow.id, ObservationRow.verdict)
                .where(ObservationRow.backend == backend, ObservationRow.canary_id == canary_id)
                .order_by(text("id DESC"))
            )
            yield from s.exec(q.execution_options(yield_per=1000))  # type: ignore[misc]

    def run_stacks(self, backend: str) -> list[tuple[int, datetime, list[dict[str, str]]]]:
        """(run id, started, the distinct stacks its observations showed) per run, newest first."""
        with self._session() as s:
            q = (
                select(EventRow.run_id, RunRow.started_at, OutcomeRow.stack_hash)
                .join(OutcomeRow, col(OutcomeRow.id) == EventRow.outcome_id)
                .join(RunRow, col(RunRow.id) == EventRow.run_id)
                .where(OutcomeRow.backend == backend, col(OutcomeRow.stack_hash).is_not(None))
                .distinct()
            )
            runs: dict[int, tuple[datetime, set[str]]] = {}
            for run_id, started, h in s.exec(q):
                runs.setdefault(run_id, (started, set()))[1].add(h)
            fields: dict[str, dict] = {}
            for _, hashes in runs.values():
                for h in hashes - fields.keys():
                    fields[h] = s.get(StackRow, h).fields  # type: ignore[union-attr]
            return [
                (run_id, started, [fields[h] for h in sorted(hashes)])
                for run_id, (started, hashes) in sorted(runs.items(), reverse=True)
            ]

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
