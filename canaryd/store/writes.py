"""The write side of the store: runs, observations, baselines, keeps, calibrations, the detector, pruning.

Every write is one transaction, and all of them are safe with other writers on the same database: several
daemons (distinct instance names) may write one PostgreSQL database at once, and the daemon and the CLI
share a SQLite file. Content-addressed rows (stack, payload, request, outcome) are inserted with ON
CONFLICT DO NOTHING, so identical content from two writers is one row and never an error. Baselines are
shared: one per backend × canary × serving configuration (`canaryd.stack.configuration_of`) for the whole
fleet, whichever instance observed it (the first to commit a first observation wins; ``baseline accept``
takes the latest of any).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import TypeVar

import structlog
from sqlalchemy import bindparam, delete, or_, update
from sqlalchemy.orm import aliased
from sqlmodel import Session, SQLModel, col, select

from canaryd.observation import Observation, canonical_digest, utcnow
from canaryd.stack import configuration_of
from canaryd.stack import stack_hash as hash_of
from canaryd.store.cache import latest_configuration
from canaryd.store.engine import Connected
from canaryd.store.records import Accepted, ComparisonLike, DetectorDoc, NoiseModelLike, detector_start
from canaryd.store.schema import (
    PAYLOAD_FORMAT,
    BaselineRow,
    CalibrationRow,
    DetectorRow,
    EventRow,
    KeepRow,
    ObservationRow,
    OutcomeRow,
    PayloadRow,
    RequestRow,
    RunRow,
    StackRow,
    compress_payload,
    payload_key,
)

T = TypeVar("T")
# Verdicts whose observation becomes its configuration's baseline: the first one, and the first of a
# configuration new to a canary that has baselines under others.
FIRST_OF_CONFIGURATION = ("baseline", "new-configuration")


Written = tuple[Observation, ComparisonLike, "int | None"]  # what `Writes.record` takes per observation
log = structlog.get_logger("canaryd.store")


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

_DET = DetectorRow.__table__  # type: ignore[attr-defined]
_DETECTOR_READ = (
    select(_DET.c.statistic, _DET.c.cycles, _DET.c.alarm, _DET.c.pending)
    .where(_DET.c.backend == bindparam("key"))
    .with_for_update()  # PostgreSQL: the row stays locked until the fold commits
)
_DETECTOR_WRITE = (
    update(_DET)
    .where(_DET.c.backend == bindparam("key"))
    .values({c: bindparam(f"v_{c}") for c in ("statistic", "cycles", "alarm", "pending", "updated_at")})
)
_DETECTOR_INSERT: dict[str, object] = {}


def _detector_insert(dialect: str):
    """The backend's detector row at its start unless it exists (ON CONFLICT DO NOTHING), per dialect."""
    stmt = _DETECTOR_INSERT.get(dialect)
    if stmt is None:
        if dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert
        else:
            from sqlalchemy.dialects.sqlite import insert
        stmt = _DETECTOR_INSERT[dialect] = insert(_DET).on_conflict_do_nothing()
    return stmt


_EVENT = EventRow.__table__.insert()  # type: ignore[attr-defined]
_RUN = RunRow.__table__.insert()  # type: ignore[attr-defined]


class Writes(Connected):
    """The store's writes (a mixin of `canaryd.store.Store`, which sets these attributes)."""

    instance: str  # recorded on every run this store starts
    _detector_lock: threading.Lock  # serialises this process's detector folds

    # -- runs and observations ------------------------------------------------------------------------
    def start_run(self, backend: str) -> int:
        with self.engine.begin() as conn:
            values = {"backend": backend, "instance": self.instance, "started_at": utcnow(), "canaries": 0}
            return conn.execute(_RUN, values).inserted_primary_key[0]

    def finish_run(self, run_id: int, canaries: int) -> None:
        with self._session() as s:
            self._finish(s, run_id, canaries)
            s.commit()

    @staticmethod
    def _finish(s: Session, run_id: int, canaries: int) -> None:
        s.connection().execute(
            update(RunRow.__table__)  # type: ignore[arg-type]
            .where(RunRow.__table__.c.id == run_id)  # type: ignore[attr-defined]
            .values(finished_at=utcnow(), canaries=canaries)
        )

    def add_observation(
        self, run_id: int, obs: Observation, comparison: ComparisonLike, baseline_id: int | None
    ) -> int:
        """Write one observation in a transaction of its own (`record` writes a pass's in one)."""
        learned: set[str] = set()
        with self._session() as s:
            event_id = self._write(s, run_id, (obs, comparison, baseline_id), set(), learned)
            s.commit()
        self._cache.learn(learned)
        return event_id

    def record(self, run_id: int, items: Sequence[Written], canaries: int) -> list[int | Exception]:
        """A pass's observations (each: observation, comparison, baseline id) and the end of its run, in one
        transaction; the event id of each, in order.

        If that transaction fails (a value the database refuses, a known key another process pruned),
        nothing of it stays: the known keys are forgotten and each observation is written in a transaction
        of its own, so a failure costs only its own observation (its exception takes its place in the list,
        for the caller to record something else).
        """
        learned: set[str] = set()
        try:
            with self._session() as s:
                ids: list[int | Exception] = [
                    self._write(s, run_id, item, self._cache.known, learned) for item in items
                ]
                self._finish(s, run_id, canaries)
                s.commit()
        except Exception as e:
            log.warning("pass_write_retried", run_id=run_id, error=f"{e.__class__.__name__}: {str(e)[:200]}")
            self._cache.forget()
            ids = []
            for item in items:
                try:
                    ids.append(self.add_observation(run_id, *item))
                except Exception as failed:
                    ids.append(failed)
            self.finish_run(run_id, canaries)
            return ids
        self._cache.learn(learned)
        return ids

    def _write(self, s: Session, run_id: int, item: Written, known: set[str], learned: set[str]) -> int:
        """One observation into ``s``; what it shares with earlier ones is stored once.

        The stack, payload, request and outcome are content-addressed, so an identical repeat adds one
        ``event`` row (time, latency, headers) and nothing else. A key in ``known`` exists; any other is
        looked up (the common case: it exists, and nothing is sent or locked) and otherwise inserted with ON
        CONFLICT DO NOTHING, so a concurrent writer of the same content is no error. Keys now known to exist
        go to ``learned``.
        """
        obs, comparison, baseline_id = item
        verdict = str(comparison.verdict.value)
        stack_hash = None
        if obs.stack:
            stack_hash = hash_of(obs.stack)
            if stack_hash not in known and not self._exists(s, StackRow, stack_hash):
                _insert_ignore(s, StackRow, hash=stack_hash, fields=obs.stack, first_seen=obs.started_at)
            learned.add(stack_hash)
        payload_hash = None
        if obs.tokens:
            payload_hash, canonical = payload_key(obs.tokens)
            if payload_hash not in known and not self._exists(s, PayloadRow, payload_hash):
                data = compress_payload(canonical)
                _insert_ignore(s, PayloadRow, hash=payload_hash, format=PAYLOAD_FORMAT, data=data)
            learned.add(payload_hash)
        ref = obs.request_ref
        if ref not in known and not self._exists(s, RequestRow, ref):
            _insert_ignore(s, RequestRow, hash=ref, body=obs.request)
        learned.add(ref)
        fields = {
            "backend": obs.backend,
            "canary_id": obs.canary_id,
            "suite": obs.suite,
            "request_ref": ref,
            "request_hash": obs.request_hash,
            "text": obs.text,
            "finish_reason": obs.finish_reason,
            "prompt_tokens": obs.prompt_tokens,
            "completion_tokens": obs.completion_tokens,
            "reasoning_tokens": obs.reasoning_tokens,
            "has_logprobs": obs.has_logprobs,
            "system_fingerprint": obs.system_fingerprint,
            "response_model": obs.response_model,
            "stack_hash": stack_hash,
            "payload_hash": payload_hash,
            "error": obs.error,
            "error_kind": obs.error_kind.value if obs.error_kind else None,
            "correct": comparison.correct,
            "verdict": verdict,
            "comparison": comparison.as_dict(),
            "baseline_id": baseline_id,
        }
        outcome_hash = canonical_digest(fields)
        by_hash = _BY_HASH["outcome"], {"key": outcome_hash}
        outcome_id = s.connection().execute(*by_hash).scalar()
        if outcome_id is None:
            _insert_ignore(s, OutcomeRow, hash=outcome_hash, **fields)
            # ours, or a concurrent writer's (committed by now: our insert waited for it)
            outcome_id = s.connection().execute(*by_hash).scalar_one()
        event = {
            "run_id": run_id,
            "outcome_id": outcome_id,
            "started_at": obs.started_at,
            "latency_s": obs.latency_s,
            "headers": obs.headers,
        }
        event_id = s.connection().execute(_EVENT, event).inserted_primary_key[0]
        if verdict in FIRST_OF_CONFIGURATION:
            self._first_baseline(s, obs, event_id, baseline_id)
        return event_id

    @staticmethod
    def _exists(s: Session, table: type[SQLModel], key: str) -> bool:
        return s.connection().execute(_BY_HASH[table.__tablename__], {"key": key}).first() is not None

    # -- baselines and keeps --------------------------------------------------------------------------
    @staticmethod
    def _first_baseline(
        s: Session, obs: Observation, observation_id: int, judged_against: int | None
    ) -> None:
        """Make this observation the baseline, unless another instance just made one for the same request.

        A ``baseline`` verdict means there was no baseline, or the judge refused the one it was shown
        (``judged_against``): it was for an older request of the canary, or unusable. Two instances of a
        fleet can judge so at the same moment: the first to commit wins (the baseline is the *first*
        observation), the other's observation stays an ordinary one.
        """
        configuration = configuration_of(obs.stack)
        key = {"backend": obs.backend, "canary_id": obs.canary_id, "configuration": configuration}
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
            .where(
                BaselineRow.backend == obs.backend,
                BaselineRow.canary_id == obs.canary_id,
                BaselineRow.configuration == configuration,
            )
            .with_for_update()  # PostgreSQL: serialise replacers (SQLite: this transaction holds the lock)
        ).one()
        request_hash = s.exec(
            select(OutcomeRow.request_hash)
            .join(EventRow, col(EventRow.outcome_id) == OutcomeRow.id)
            .where(EventRow.id == current)
        ).first()
        # a baseline for an older request, or the very one the judge refused (not one a concurrent writer
        # just put in its place): replace it
        if request_hash != obs.request_hash or (judged_against is not None and current == judged_against):
            Writes._set_baseline(
                s, obs.backend, obs.canary_id, configuration, observation_id, "first observation"
            )

    @staticmethod
    def _set_baseline(
        s: Session, backend: str, canary_id: str, configuration: str, observation_id: int, note: str
    ) -> None:
        """Upsert: the baseline of backend × canary × configuration is now this observation (the last
        writer wins)."""
        stmt = _insert(s, BaselineRow).values(
            backend=backend,
            canary_id=canary_id,
            configuration=configuration,
            observation_id=observation_id,
            accepted_at=utcnow(),
            note=note,
        )
        s.connection().execute(
            stmt.on_conflict_do_update(
                index_elements=["backend", "canary_id", "configuration"],
                set_={
                    "observation_id": stmt.excluded.observation_id,
                    "accepted_at": stmt.excluded.accepted_at,
                    "note": stmt.excluded.note,
                },
            )
        )

    def accept_latest(self, backend: str | None = None, canary_id: str | None = None) -> list[Accepted]:
        """Make the latest successful observation of each canary × backend × serving configuration the
        baseline of that configuration, for the configurations that served the backend's latest run (an
        intended change accepted on one server does not re-baseline configurations no longer serving).

        Across the whole database: in a fleet, the latest observation of any instance. A chained
        canary's id selects every one of its steps (``id:step``).
        """
        accepted = []
        with self._session() as s:
            o = ObservationRow
            q = select(o.backend, o.canary_id, o.id, o.stack_hash, o.run_id).where(
                o.error.is_(None)  # type: ignore[union-attr]
            )
            if backend:
                q = q.where(o.backend == backend)
            if canary_id:
                q = q.where(
                    (o.canary_id == canary_id) | o.canary_id.startswith(f"{canary_id}:", autoescape=True)  # type: ignore[attr-defined]
                )
            latest: dict[tuple[str, str, str], int] = {}
            last_run: dict[str, int] = {}
            serving: dict[tuple[str, int], set[str]] = {}
            configurations: dict[str | None, str] = {None: ""}
            for b, c, oid, h, run in s.exec(q.order_by(o.id)):  # type: ignore[arg-type]
                if h not in configurations:
                    stack = s.get(StackRow, h)
                    configurations[h] = configuration_of(stack.fields if stack else {})
                latest[(b, c, configurations[h])] = oid
                last_run[b] = max(run, last_run.get(b, run))
                serving.setdefault((b, run), set()).add(configurations[h])
            for (b, c, k), oid in sorted(latest.items()):
                if k in serving[(b, last_run[b])]:
                    self._set_baseline(s, b, c, k, oid, "accepted")
                    accepted.append(Accepted(b, c, oid, k))
            s.commit()
        return accepted

    def keep(self, observation_ids: Sequence[int], reason: str) -> None:
        """Mark observations as referenced from outside the store (a pin, preflight or record)."""
        with self._session() as s:
            for oid in sorted(set(observation_ids)):
                _insert_ignore(s, KeepRow, observation_id=oid, reason=reason, at=utcnow())
            s.commit()

    # -- calibrations and the detector ----------------------------------------------------------------
    def save_calibration(
        self, backend: str, canary_id: str, model: NoiseModelLike, configuration: str | None = None
    ) -> None:
        """Replace the noise model of the canary under a serving configuration (None: its latest baseline's)
        and restart the backend's detector (its evidence was gathered against the old model)."""
        if configuration is None:
            configuration = latest_configuration(self.baselines(backend, canary_id)) or ""  # type: ignore[attr-defined]
        with self._session() as s:
            key = (backend, canary_id, configuration)
            row = s.get(CalibrationRow, key) or CalibrationRow(
                backend=backend, canary_id=canary_id, configuration=configuration
            )
            row.request_hash, row.created_at, row.k = model.request_hash, utcnow(), model.k
            row.regime, row.summary, row.model = str(model.regime.value), model.summary(), model.as_dict()
            s.add(row)
            self._reset_detector(s, backend)
            s.commit()

    def drop_calibrations(self, keys: Sequence[tuple[str, ...]]) -> int:
        """Forget noise models (an accepted baseline outdates them): each key is (backend, canary id,
        configuration), or (backend, canary id) for every configuration of the canary."""
        with self._session() as s:
            dropped = set()
            for backend, canary_id, *configuration in keys:
                c = CalibrationRow
                q = select(c).where(c.backend == backend, c.canary_id == canary_id)
                if configuration:
                    q = q.where(c.configuration == configuration[0])
                for row in s.exec(q):
                    s.delete(row)
                    dropped.add((backend, canary_id, row.configuration))
            for backend in {b for b, _, _ in dropped}:  # an alarm raised by canaries still calibrated stands
                self._reset_detector(s, backend)
            s.commit()
            return len(dropped)

    def fold_detector(self, backend: str, step: Callable[[DetectorDoc], tuple[DetectorDoc | None, T]]) -> T:
        """Advance the backend's e-CUSUM atomically: ``step`` maps the stored state to the next (None: keep
        it) and a result, which this returns. Schedules sharing a backend run at once, and a lost update
        could clear a raised alarm: one lock in this process and, for a fleet, the database's: the row on
        PostgreSQL (``FOR UPDATE``), the write lock SQLite takes at the transaction's first statement (an
        insert, so no read ever upgrades to a write)."""
        with self._detector_lock, self._session() as s:
            conn = s.connection()  # Core statements, built once (the ORM's row and flush cost more)
            start = {"backend": backend, **detector_start(), "updated_at": utcnow()}
            conn.execute(_detector_insert(conn.dialect.name), start)
            row = conn.execute(_DETECTOR_READ, {"key": backend}).one()
            stored: DetectorDoc = {
                "statistic": row.statistic,
                "cycles": row.cycles,
                "alarm": row.alarm,
                "pending": list(row.pending),
            }
            new, result = step(stored)
            if new is not None:
                values = {
                    "key": backend,
                    "v_statistic": new["statistic"],
                    "v_cycles": new["cycles"],
                    "v_alarm": new["alarm"],
                    "v_pending": list(new["pending"]),
                    "v_updated_at": utcnow(),
                }
                conn.execute(_DETECTOR_WRITE, values)
                s.commit()
            return result

    @staticmethod
    def _reset_detector(s: Session, backend: str) -> None:
        row = s.get(DetectorRow, backend)
        if row is not None:
            s.delete(row)

    # -- retention ------------------------------------------------------------------------------------
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
        if not dry_run:
            self._cache.forget()  # known keys may be gone
        if not dry_run and self.engine.dialect.name == "sqlite":
            with self.engine.connect() as conn:  # fold the WAL into the database file and truncate it
                conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
        return counts
