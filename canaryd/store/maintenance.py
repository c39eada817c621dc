"""Retention: ``canaryd prune`` deletes old observations, then whatever only they used."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import delete, or_
from sqlalchemy.orm import aliased
from sqlmodel import col, select

from canaryd.store.engine import Connected
from canaryd.store.schema import (
    BaselineRow,
    EventRow,
    KeepRow,
    ObservationRow,
    OutcomeRow,
    PayloadRow,
    RequestRow,
    RunRow,
    StackRow,
)


class Maintenance(Connected):
    """The store's retention (a mixin of `canaryd.store.Store`)."""

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
