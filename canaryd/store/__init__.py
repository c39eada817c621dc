"""The history: every run, observation, stack snapshot and baseline, in SQLite (or PostgreSQL).

Layout, chosen so that storage grows with change rather than with time:

* ``run``: one pass of one backend by one canaryd ``instance`` (the daemon's name, default the hostname).
* ``stack``: one row per distinct stack snapshot, keyed by its hash.
* ``payload``: token-level data (tokens, ids, bytes, logprobs, top-k) as zlib-compressed canonical JSON,
  keyed by content hash. JSON floats round-trip float64 exactly, so nothing is lost; an unchanged answer
  re-uses the existing row.
* ``request``: the exact request body sent, keyed by content hash (a canary's request rarely changes).
* ``outcome``: what an observation saw and how it was judged (text, usage, fingerprint, stack, payload,
  verdict, the comparison with its baseline), keyed by content hash: an identical repeat re-uses it.
* ``event``: one thin row per canary × backend × probe: run, time, latency, per-request headers and its
  outcome. This is all an unchanged probe costs (about 100 bytes; see ``bench/storage_bench.py``).
* ``observation``: a view over event ⋈ outcome ⋈ request ⋈ run, with the columns one observation always had
  (and the probing instance); reads go here.
* ``baseline``: the observation each canary × backend is compared against.
* ``keep``: observations a pin, preflight or record refers to; ``prune`` never deletes them.
* ``calibration``: the noise model ``baseline calibrate`` learned per backend × canary (``stats.NoiseModel``).
* ``detector``: each backend's e-CUSUM statistic and alarm, carried across cycles and restarts.

The schema is built and changed only by the Alembic migrations in ``canaryd/migrations`` (SQLite and
PostgreSQL alike): every ``Store`` brings its database to the head revision first (``migrate``).

Fleets: several daemons (distinct instance names) may write one PostgreSQL database at once. Content-
addressed rows are inserted with ON CONFLICT DO NOTHING, so identical content from two writers is one row
and never an error. Baselines are shared: one per backend × canary for the whole fleet, whichever instance
observed it (the first to commit a first observation wins; ``baseline accept`` takes the latest of any).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import TypeVar

import structlog
from sqlalchemy import JSON, Column, Index, LargeBinary, bindparam, delete, event, inspect, or_, text
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import aliased
from sqlmodel import Field, Session, SQLModel, col, create_engine, select

from canaryd.errors import InputError
from canaryd.judge.compare import Comparison
from canaryd.judge.stats import DetectorState, NoiseModel
from canaryd.observation import ErrorKind, Observation, TokenLogprob, utcnow
from canaryd.stack import stack_hash as hash_of

PAYLOAD_FORMAT = 1
log = structlog.get_logger("canaryd.store")
T = TypeVar("T")


class SchemaMismatch(SQLAlchemyError):
    """The database predates migrations, or a newer canaryd migrated it (exit 4, one line)."""


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _canonical(doc: object) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str).encode()


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
    """One observation as it reads: a view over event ⋈ outcome ⋈ request ⋈ run (never written directly).

    The view's SQL lives in the migrations (``canaryd/migrations/versions``); tests/test_migrations.py
    checks that its columns are these.
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


class CalibrationRow(SQLModel, table=True):
    """The calibrated noise model of one canary × backend (replaced by each ``baseline calibrate``)."""

    __tablename__ = "calibration"
    backend: str = Field(primary_key=True)
    canary_id: str = Field(primary_key=True)
    request_hash: str  # the request it was learned for; another request ignores it
    created_at: datetime
    k: int
    regime: str
    summary: dict = Field(sa_column=Column(JSON, nullable=False))
    model: dict = Field(sa_column=Column(JSON, nullable=False))


class DetectorRow(SQLModel, table=True):
    """One backend's sequential detector (see ``compare.decide``)."""

    __tablename__ = "detector"
    backend: str = Field(primary_key=True)
    statistic: float
    cycles: int
    alarm: bool
    pending: list = Field(sa_column=Column(JSON, nullable=False))
    updated_at: datetime


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
    """An engine for a history database, without touching its schema (``migrate`` does that)."""
    u = make_url(url)
    if u.drivername == "postgresql":  # psycopg 3 (the `postgres` extra), not SQLAlchemy's psycopg2 default
        u = u.set(drivername="postgresql+psycopg")
    if u.get_backend_name() == "sqlite":
        if u.database and u.database != ":memory:":
            Path(u.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        # Wait up to 30 s for another writer's lock (Python's default is 5 s); `?timeout=N` in the URL wins.
        engine = create_engine(u, connect_args={} if "timeout" in u.query else {"timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    if u.get_backend_name() == "postgresql":
        try:
            import psycopg  # noqa: F401
        except ImportError:
            raise InputError(
                f"storage url {u.render_as_string()}: PostgreSQL needs psycopg: "
                "pip install 'canaryd[postgres]'"
            ) from None
    return create_engine(u, pool_pre_ping=True)


# -- schema migrations (Alembic) ------------------------------------------------------------------------
# One way to build the schema: `canaryd/migrations/versions`, from the empty database up. Every Store runs
# them (the daemon before READY=1); `canaryd db upgrade` runs them explicitly.

MIGRATIONS = Path(__file__).with_name("migrations")
SCHEMA_REVISION = "0003"  # the head revision (tests/test_migrations.py checks it against the scripts)
TABLES = frozenset(
    {"run", "stack", "payload", "request", "outcome", "event", "observation", "baseline", "keep"}
)
_PG_MIGRATION_LOCK = 0x63616E61727964  # "canaryd": one migrator at a time per PostgreSQL database


def include_object(_obj, name, type_, _reflected, _compare_to) -> bool:
    """Autogenerate filter: ``observation`` is a view, written by hand in the revisions."""
    return not (type_ == "table" and name == "observation")


def _empty_string(sql: str | None) -> bool:
    while sql and sql.startswith("(") and sql.endswith(")"):
        sql = sql[1:-1]
    return sql is not None and sql.split("::")[0] in ("''", "")


def compare_server_default(
    _ctx, _conn_col, _meta_col, conn_default, _meta_default, meta_default
) -> bool | None:
    """Alembic's own comparison, except that it takes SQLite's ``''`` for a different default than ``""``."""
    if _empty_string(conn_default) and _empty_string(meta_default):
        return False
    return None


# What `alembic revision --autogenerate` and `alembic check` compare (env.py and tests/test_migrations.py).
AUTOGENERATE_OPTIONS = {
    "include_object": include_object,
    "compare_type": True,
    "compare_server_default": compare_server_default,
}


def alembic_config(connection: Connection | None = None, url: str | None = None):
    """Alembic's configuration, built in code: no alembic.ini is needed at run time."""
    from alembic.config import Config as AlembicConfig

    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("path_separator", "os")
    if url is not None:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.attributes["connection"] = connection
    return cfg


def known_revisions() -> set[str]:
    """Every revision this canaryd's migrations know."""
    from alembic.script import ScriptDirectory

    return {s.revision for s in ScriptDirectory.from_config(alembic_config()).walk_revisions()}


def _label(engine: Engine) -> str:
    return engine.url.render_as_string(hide_password=True)


def _read_revision(engine: Engine, conn: Connection) -> str | None:
    """The database's revision; None for an empty one. A pre-migration database is a SchemaMismatch."""
    inspector = inspect(conn)
    names = set(inspector.get_table_names()) | set(inspector.get_view_names())
    rev = None
    if "alembic_version" in names:
        rev = conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar()
    if rev is None and names & TABLES:
        raise SchemaMismatch(
            f"{_label(engine)}: written by an older canaryd, from before schema migrations "
            "(canaryd tables but no alembic_version): move the database aside"
        )
    return rev


def current_revision(engine: Engine) -> str | None:
    """The schema revision the database is at (None: empty), without changing anything."""
    if _new_sqlite_file(engine) is not None:
        return None  # connecting would create the file
    with engine.connect() as conn:
        return _read_revision(engine, conn)


def migrate(engine: Engine) -> tuple[str | None, str]:
    """Bring the database to the head revision; (revision before, revision after).

    Cheap when nothing is to do (one query). Otherwise takes a lock first, so that several daemons starting
    on one database migrate it once: ``pg_advisory_xact_lock`` on PostgreSQL, ``BEGIN IMMEDIATE`` (the
    write lock) on SQLite; the migration runs inside that one transaction and is re-checked under the lock.
    A new SQLite file is built beside its path and linked into place whole, so that no reader ever finds
    the file without its schema.
    """
    path = _new_sqlite_file(engine)
    if path is not None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.new")
        fresh = make_engine(engine.url.set(database=str(tmp)).render_as_string(hide_password=False))
        try:
            _migrate(fresh)
            fresh.dispose()  # the last connection: the WAL is checkpointed into the file and removed
            try:
                os.link(tmp, path)  # atomic, and never over a database another process just created
            except FileExistsError:
                pass
            except OSError:  # a file system without hard links
                if not path.exists():
                    os.replace(tmp, path)
        finally:
            fresh.dispose()
            for leftover in (tmp, Path(f"{tmp}-wal"), Path(f"{tmp}-shm")):
                leftover.unlink(missing_ok=True)
        _, after = _migrate(engine)
        return None, after
    return _migrate(engine)


def _new_sqlite_file(engine: Engine) -> Path | None:
    """The path of a SQLite database file that does not exist yet (None otherwise)."""
    db = engine.url.database
    if engine.dialect.name != "sqlite" or not db or db == ":memory:" or db.startswith("file:"):
        return None
    path = Path(db).expanduser()
    return None if path.exists() else path


def _migrate(engine: Engine) -> tuple[str | None, str]:
    before = current_revision(engine)
    if before == SCHEMA_REVISION:
        return before, before
    from alembic import command

    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_PG_MIGRATION_LOCK})")
        elif engine.dialect.name == "sqlite":
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        before = _read_revision(engine, conn)
        if before is not None and before not in known_revisions():
            raise SchemaMismatch(
                f"{_label(engine)}: schema revision {before} is newer than this canaryd "
                f"(head {SCHEMA_REVISION}): upgrade canaryd"
            )
        if before != SCHEMA_REVISION:
            command.upgrade(alembic_config(conn), "head")
    return before, current_revision(engine) or ""


def _insert(s: Session, table: type[SQLModel]):
    """The dialect's INSERT, which has ``on_conflict_do_nothing``/``_do_update`` (SQLite and PostgreSQL)."""
    if s.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    return insert(table.__table__)  # type: ignore[attr-defined]


def _insert_ignore(s: Session, table: type[SQLModel], **values: object) -> bool:
    """Insert a content-addressed row unless its key is already there; True if this call inserted it.

    ``INSERT ... ON CONFLICT DO NOTHING``: when several processes (a fleet on one PostgreSQL, or the daemon
    and a CLI on one SQLite file) store the same content at once, one row results and nobody fails. On
    PostgreSQL a concurrent inserter of the same key waits for the first transaction and then does nothing.
    Core statements on the session's connection (the ORM adds nothing here but time).
    """
    return s.connection().execute(_insert(s, table).values(**values).on_conflict_do_nothing()).rowcount > 0


# Look-ups of content-addressed rows by hash, built once (building a statement costs more than running it).
_BY_HASH = {
    t.__tablename__: select(t.__table__.c.id if t is OutcomeRow else t.__table__.c.hash).where(  # type: ignore[attr-defined]
        t.__table__.c.hash == bindparam("key")  # type: ignore[attr-defined]
    )
    for t in (StackRow, PayloadRow, RequestRow, OutcomeRow)
}


class Store:
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
            log.info("schema_migrated", database=_label(self.engine), before=before, after=after)

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
            run = RunRow(backend=backend, instance=self.instance, started_at=utcnow())
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
        ``event`` row (time, latency, headers) and nothing else. Each is looked up first (the common case:
        it exists, and nothing is sent or locked) and otherwise inserted with ON CONFLICT DO NOTHING, so a
        concurrent writer of the same content is no error.
        """
        with self._session() as s:
            stack_hash = None
            if obs.stack:
                stack_hash = hash_of(obs.stack)
                if not self._exists(s, StackRow, stack_hash):
                    _insert_ignore(s, StackRow, hash=stack_hash, fields=obs.stack, first_seen=obs.started_at)
            payload_hash = None
            if obs.tokens:
                payload_hash, data = _encode_payload(obs.tokens)
                if not self._exists(s, PayloadRow, payload_hash):
                    _insert_ignore(s, PayloadRow, hash=payload_hash, format=PAYLOAD_FORMAT, data=data)
            request_ref = _digest(_canonical(obs.request))
            if not self._exists(s, RequestRow, request_ref):
                _insert_ignore(s, RequestRow, hash=request_ref, body=obs.request)
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
            by_hash = _BY_HASH["outcome"], {"key": outcome_hash}
            outcome_id = s.connection().execute(*by_hash).scalar()
            if outcome_id is None:
                _insert_ignore(s, OutcomeRow, hash=outcome_hash, **fields)
                # ours, or a concurrent writer's (committed by now: our insert waited for it)
                outcome_id = s.connection().execute(*by_hash).scalar_one()
            row = EventRow(
                run_id=run_id,
                outcome_id=outcome_id,
                started_at=obs.started_at,
                latency_s=obs.latency_s,
                headers=obs.headers,
            )
            s.add(row)
            s.flush()
            if comparison.verdict.value == "baseline":
                self._first_baseline(s, obs, row.id)  # type: ignore[arg-type]
            s.commit()
            return row.id  # type: ignore[return-value]

    @staticmethod
    def _exists(s: Session, table: type[SQLModel], key: str) -> bool:
        return s.connection().execute(_BY_HASH[table.__tablename__], {"key": key}).first() is not None

    @staticmethod
    def _first_baseline(s: Session, obs: Observation, observation_id: int) -> None:
        """Make this observation the baseline, unless another instance just made one for the same request.

        A ``baseline`` verdict means there was no baseline, or it was for an older request of the canary.
        Two instances of a fleet can judge so at the same moment: the first to commit wins (the baseline is
        the *first* observation), the other's observation stays an ordinary one.
        """
        key = {"backend": obs.backend, "canary_id": obs.canary_id}
        if _insert_ignore(
            s,
            BaselineRow,
            **key,
            observation_id=observation_id,
            accepted_at=utcnow(),
            note="first observation",
        ):
            return
        current = s.exec(
            select(BaselineRow.observation_id)
            .where(BaselineRow.backend == obs.backend, BaselineRow.canary_id == obs.canary_id)
            .with_for_update()  # PostgreSQL: serialise replacers (SQLite: this transaction holds the lock)
        ).one()
        request_hash = s.exec(
            select(OutcomeRow.request_hash)
            .join(EventRow, col(EventRow.outcome_id) == OutcomeRow.id)
            .where(EventRow.id == current)
        ).first()
        if request_hash != obs.request_hash:  # a baseline for an older request: replace it
            Store._set_baseline(s, obs.backend, obs.canary_id, observation_id, "first observation")

    @staticmethod
    def _set_baseline(s: Session, backend: str, canary_id: str, observation_id: int, note: str) -> None:
        """Upsert: the baseline of backend × canary is now this observation (the last writer wins)."""
        stmt = _insert(s, BaselineRow).values(
            backend=backend,
            canary_id=canary_id,
            observation_id=observation_id,
            accepted_at=utcnow(),
            note=note,
        )
        s.connection().execute(
            stmt.on_conflict_do_update(
                index_elements=["backend", "canary_id"],
                set_={
                    "observation_id": stmt.excluded.observation_id,
                    "accepted_at": stmt.excluded.accepted_at,
                    "note": stmt.excluded.note,
                },
            )
        )

    def accept_latest(
        self, backend: str | None = None, canary_id: str | None = None
    ) -> list[tuple[str, str, int]]:
        """Make the latest successful observation of each canary × backend its baseline.

        Across the whole database: in a fleet, the latest observation of any instance. A chained
        canary's id selects every one of its steps (``id:step``).
        """
        accepted = []
        with self._session() as s:
            q = select(ObservationRow).where(ObservationRow.error.is_(None))  # type: ignore[union-attr]
            if backend:
                q = q.where(ObservationRow.backend == backend)
            if canary_id:
                q = q.where(
                    (ObservationRow.canary_id == canary_id)
                    | ObservationRow.canary_id.startswith(f"{canary_id}:", autoescape=True)  # type: ignore[attr-defined]
                )
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
            for oid in sorted(set(observation_ids)):
                _insert_ignore(s, KeepRow, observation_id=oid, reason=reason, at=utcnow())
            s.commit()

    def save_calibration(self, backend: str, canary_id: str, model: NoiseModel) -> None:
        """Replace the canary's noise model and restart the backend's detector (its evidence was
        gathered against the old model)."""
        with self._session() as s:
            row = s.get(CalibrationRow, (backend, canary_id)) or CalibrationRow(
                backend=backend, canary_id=canary_id
            )
            row.request_hash, row.created_at, row.k = model.request_hash, utcnow(), model.k
            row.regime, row.summary, row.model = model.regime.value, model.summary(), model.as_dict()
            s.add(row)
            self._reset_detector(s, backend)
            s.commit()

    def drop_calibrations(self, pairs: Sequence[tuple[str, str]]) -> int:
        """Forget the noise models of these backend × canary pairs (an accepted baseline outdates them)."""
        with self._session() as s:
            dropped = set()
            for backend, canary_id in pairs:
                row = s.get(CalibrationRow, (backend, canary_id))
                if row is not None:
                    s.delete(row)
                    dropped.add((backend, canary_id))
            for backend in {b for b, _ in dropped}:  # an alarm raised by canaries still calibrated stands
                self._reset_detector(s, backend)
            s.commit()
            return len(dropped)

    def fold_detector(
        self, backend: str, step: Callable[[DetectorState], tuple[DetectorState | None, T]]
    ) -> T:
        """Advance the backend's e-CUSUM atomically: ``step`` maps the stored state to the next (None: keep
        it) and a result, which this returns. Schedules sharing a backend run at once, and a lost update
        could clear a raised alarm: one lock in this process and, for a fleet, the database's: the row on
        PostgreSQL (``FOR UPDATE``), the write lock SQLite takes at the transaction's first statement (an
        insert, so no read ever upgrades to a write)."""
        with self._detector_lock, self._session() as s:
            fresh = DetectorState()
            _insert_ignore(
                s,
                DetectorRow,
                backend=backend,
                statistic=fresh.statistic,
                cycles=fresh.cycles,
                alarm=fresh.alarm,
                pending=list(fresh.pending),
                updated_at=utcnow(),
            )
            row = s.exec(select(DetectorRow).where(DetectorRow.backend == backend).with_for_update()).one()
            new, result = step(DetectorState(row.statistic, row.cycles, row.alarm, tuple(row.pending)))
            if new is not None:
                row.statistic, row.cycles, row.alarm, row.pending, row.updated_at = (
                    new.statistic,
                    new.cycles,
                    new.alarm,
                    list(new.pending),
                    utcnow(),
                )
                s.add(row)
                s.commit()
            return result

    @staticmethod
    def _reset_detector(s: Session, backend: str) -> None:
        row = s.get(DetectorRow, backend)
        if row is not None:
            s.delete(row)

    def prune(self, cutoff: datetime, *, dry_run: bool = False) -> dict[str, int]:
        """Delete observations started before ``cutoff``, then what only they used; counts per table.

        Never deleted: current baselines (a sampled canary's: every draw of its run, see `run_set`), kept
        observations, and the baselines that any surviving observation was judged against (its comparison
        names them). A dry run deletes inside a transaction and rolls it back, so its counts are exactly
        what a real run would delete.
        """
        base = aliased(ObservationRow)
        baseline_sets = (
            select(ObservationRow.id)
            .join(base, (base.run_id == ObservationRow.run_id) & (base.canary_id == ObservationRow.canary_id))
            .where(col(base.id).in_(select(BaselineRow.observation_id)))
        )
        survives = or_(
            col(EventRow.started_at) >= cutoff,
            col(EventRow.id).in_(baseline_sets),
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

    def run_set(self, observation_id: int) -> list[Observation]:
        """Every observation of the same canary in the same run as this one, in id order (= sending order).

        A sampled canary's baseline is a set: the n draws of the run its baseline observation belongs to.
        """
        with self._session() as s:
            row = s.get(ObservationRow, observation_id)
            if row is None:
                return []
            q = select(ObservationRow).where(
                ObservationRow.run_id == row.run_id, ObservationRow.canary_id == row.canary_id
            )
            return [self._to_observation(s, r) for r in s.exec(q.order_by(text("id")))]

    def calibration(self, backend: str, canary_id: str) -> NoiseModel | None:
        with self._session() as s:
            row = s.get(CalibrationRow, (backend, canary_id))
            return NoiseModel.from_dict(row.model) if row else None

    def observations(
        self,
        *,
        backend: str | None = None,
        canary_id: str | None = None,
        instance: str | None = None,
        limit: int = 50,
    ) -> list[ObservationRow]:
        """Observations, newest first; ``instance`` narrows them to what one daemon of a fleet probed."""
        with self._session() as s:
            q = select(ObservationRow)
            if backend:
                q = q.where(ObservationRow.backend == backend)
            if canary_id:
                q = q.where(ObservationRow.canary_id == canary_id)
            if instance is not None:
                q = q.where(ObservationRow.instance == instance)
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

    def run(self, run_id: int) -> RunRow | None:
        """One run (backend, instance, start and end), None when there is no such run."""
        with self._session() as s:
            return s.get(RunRow, run_id)

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
