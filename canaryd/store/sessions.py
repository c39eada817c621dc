"""Evaluation sessions: the harness runs a record describes (a mixin of `canaryd.store.Store`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime

from sqlmodel import col, select

from canaryd.store.engine import Connected
from canaryd.store.records import EvalSession
from canaryd.store.schema import EvalSessionRow


class Sessions(Connected):
    def save_session(
        self,
        *,
        started_at: datetime,
        finished_at: datetime | None,
        harness: str,
        task: str,
        samples: int,
        configurations: Mapping[str, int],
        runs_before: Sequence[int],
        runs_after: Sequence[int],
        held: bool | None,
        out_dir: str,
    ) -> int:
        """Record a finished session; its id."""
        row = EvalSessionRow(
            started_at=started_at,
            finished_at=finished_at,
            harness=harness,
            task=task,
            samples=samples,
            configurations=dict(configurations),
            runs_before=sorted(set(runs_before)),
            runs_after=sorted(set(runs_after)),
            held=held,
            out_dir=out_dir,
        )
        with self._session() as s:
            s.add(row)
            s.commit()
            s.refresh(row)
            return int(row.id)  # type: ignore[arg-type]

    def sessions_of_runs(self, run_ids: Sequence[int]) -> list[EvalSession]:
        """The sessions whose runs before or after include any of ``run_ids``, oldest first."""
        wanted = set(run_ids)
        with self._session() as s:
            rows = s.exec(select(EvalSessionRow).order_by(col(EvalSessionRow.id))).all()
            return [_session(r) for r in rows if wanted & {*r.runs_before, *r.runs_after}]


def _session(r: EvalSessionRow) -> EvalSession:
    return EvalSession(
        int(r.id),  # type: ignore[arg-type]
        r.started_at,
        r.finished_at,
        r.harness,
        r.task,
        r.samples,
        {str(k): int(v) for k, v in r.configurations.items()},
        tuple(int(x) for x in r.runs_before),
        tuple(int(x) for x in r.runs_after),
        r.held,
        r.out_dir,
    )
