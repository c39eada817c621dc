"""What observations are judged against, as the store writes it: baselines, keeps, noise models and the
detector.

Baselines are shared: one per backend × canary × serving configuration (`canaryd.stack.configuration_of`)
for the whole fleet, whichever instance observed it (the first to commit a first observation wins;
``baseline accept`` takes the latest of any). A new noise model, or a dropped one, restarts the backend's
detector: its evidence was gathered against the old model.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from sqlalchemy import bindparam, update
from sqlmodel import Session, col, select

from canaryd.observation import Observation, utcnow
from canaryd.stack import configuration_of
from canaryd.store.engine import Connected, insert_ignore, insert_of
from canaryd.store.records import Accepted, DetectorDoc, NoiseModelLike, detector_start, latest_configuration
from canaryd.store.schema import (
    BaselineRow,
    CalibrationRow,
    DetectorRow,
    EventRow,
    KeepRow,
    ObservationRow,
    OutcomeRow,
    StackRow,
)

T = TypeVar("T")

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


def first_baseline(s: Session, obs: Observation, observation_id: int, judged_against: int | None) -> None:
    """Make this observation the baseline, unless another instance just made one for the same request.

    A ``baseline`` verdict means there was no baseline, or the judge refused the one it was shown
    (``judged_against``): it was for an older request of the canary, or unusable. Two instances of a
    fleet can judge so at the same moment: the first to commit wins (the baseline is the *first*
    observation), the other's observation stays an ordinary one.
    """
    configuration = configuration_of(obs.stack)
    key = {"backend": obs.backend, "canary_id": obs.canary_id, "configuration": configuration}
    if insert_ignore(
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
        set_baseline(s, obs.backend, obs.canary_id, configuration, observation_id, "first observation")


def set_baseline(
    s: Session, backend: str, canary_id: str, configuration: str, observation_id: int, note: str
) -> None:
    """Upsert: the baseline of backend × canary × configuration is now this observation (the last
    writer wins)."""
    stmt = insert_of(s, BaselineRow).values(
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


class Baselines(Connected):
    """The store's writes of what judging reads (a mixin of `canaryd.store.Store`, which sets these
    attributes)."""

    _detector_lock: threading.Lock  # serialises this process's detector folds

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
                    set_baseline(s, b, c, k, oid, "accepted")
                    accepted.append(Accepted(b, c, oid, k))
            s.commit()
        return accepted

    def keep(self, observation_ids: Sequence[int], reason: str) -> None:
        """Mark observations as referenced from outside the store (a pin, preflight or record)."""
        with self._session() as s:
            for oid in sorted(set(observation_ids)):
                insert_ignore(s, KeepRow, observation_id=oid, reason=reason, at=utcnow())
            s.commit()

    def save_calibration(
        self,
        backend: str,
        canary_id: str,
        model: NoiseModelLike,
        configuration: str | None = None,
        *,
        restart_detector: bool = True,
    ) -> None:
        """Replace the noise model of the canary under a serving configuration (None: its latest baseline's)
        and restart the backend's detector (its evidence was gathered against the old model). A model that
        replaces a learning window leaves the detector alone (``restart_detector=False``): no evidence was
        gathered against a window, and the other canaries' stands."""
        if configuration is None:
            configuration = latest_configuration(self.baselines(backend, canary_id)) or ""  # type: ignore[attr-defined]
        self._put_calibration(
            backend,
            canary_id,
            configuration,
            (model.request_hash, model.k, str(model.regime.value), model.summary(), model.as_dict()),
            restart_detector,
        )

    def save_learning(
        self, backend: str, canary_id: str, configuration: str, request_hash: str, k: int, doc: dict
    ) -> None:
        """Keep the learning window of the canary under a serving configuration (``canaryd.judge.learning``)
        in its calibration row (regime ``learning``, ``k`` the probes so far; the model is the window),
        replacing what was there; the detector is left alone."""
        summary = {
            "regime": "learning",
            "k": k,
            **{n: v for n, v in doc["learning"].items() if n != "points"},
        }
        for bulky in ("samples", "texts"):
            summary.pop(bulky, None)
        self._put_calibration(
            backend, canary_id, configuration, (request_hash, k, "learning", summary, doc), False
        )

    def _put_calibration(
        self, backend: str, canary_id: str, configuration: str, values: tuple, restart_detector: bool
    ) -> None:
        with self._session() as s:
            key = (backend, canary_id, configuration)
            row = s.get(CalibrationRow, key) or CalibrationRow(
                backend=backend, canary_id=canary_id, configuration=configuration
            )
            row.request_hash, row.k, row.regime, row.summary, row.model = values
            row.created_at = utcnow()  # moves the cache's generation: every pass re-reads a changed row
            s.add(row)
            if restart_detector:
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
