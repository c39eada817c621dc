"""The read side of the store: baselines, calibrations, observations, runs and stacks, as plain records.

Reads go through the ``observation`` view (event ⋈ outcome ⋈ request ⋈ run) and hand back the frozen
records of ``records.py``, never a table row: a row belongs to its session, and its class to the schema.
A full `Observation` (tokens, stack fields) costs a payload and a stack look-up more than its columns, so
the queries that need only the columns return `StoredObservation` alone.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import fields
from datetime import datetime

from sqlalchemy import and_, func, not_, or_, text
from sqlalchemy import select as select_core
from sqlmodel import Session, col, select

from canaryd.observation import ErrorKind, Observation
from canaryd.store.cache import Doc, Judging, Loaded, generation
from canaryd.store.engine import Connected
from canaryd.store.records import (
    Baseline,
    RunInfo,
    RunStacks,
    StackSeen,
    StoredObservation,
    latest,
    latest_configuration,
)
from canaryd.store.schema import (
    BaselineRow,
    CalibrationRow,
    EventRow,
    ObservationRow,
    OutcomeRow,
    PayloadRow,
    RunRow,
    StackRow,
    decode_payload,
)

_COLUMNS = tuple(f.name for f in fields(StoredObservation))


def _stored(row: ObservationRow) -> StoredObservation:
    """The record of a view row; its comparison with the latency evidence its event keeps (0009 on)."""
    values = {name: getattr(row, name) for name in _COLUMNS}
    if row.latency_evidence is not None:
        values["comparison"] = {**row.comparison, "latency": row.latency_evidence}
    return StoredObservation(**values)


def _to_observation(s: Session, row: ObservationRow) -> Observation:
    """The observation as it was probed: the row's columns, its tokens and its stack fields."""
    payload = s.get(PayloadRow, row.payload_hash) if row.payload_hash else None
    stack = s.get(StackRow, row.stack_hash) if row.stack_hash else None
    return _build(row, decode_payload(payload.data) if payload else [], stack.fields if stack else {})


def _observations(s: Session, rows: Sequence) -> list[Observation]:
    """`_to_observation` of many rows, with one statement for their payloads and one for their stacks."""
    payloads, stacks, conn = {}, {}, s.connection()  # Core statements: the ORM's compiling costs more
    if keys := {r.payload_hash for r in rows if r.payload_hash}:
        p = PayloadRow.__table__.c  # type: ignore[attr-defined]
        payloads = {h: data for h, data in conn.execute(select_core(p.hash, p.data).where(p.hash.in_(keys)))}
    if keys := {r.stack_hash for r in rows if r.stack_hash}:
        t = StackRow.__table__.c  # type: ignore[attr-defined]
        stacks = {h: f for h, f in conn.execute(select_core(t.hash, t.fields).where(t.hash.in_(keys)))}
    return [
        _build(
            row,
            decode_payload(payloads[row.payload_hash]) if row.payload_hash in payloads else [],
            stacks.get(row.stack_hash, {}),  # type: ignore[arg-type]
        )
        for row in rows
    ]


def _build(row, tokens: list, stack: dict) -> Observation:
    """An `Observation` from a row of the ``observation`` view (ORM or Core)."""
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
        tokens=tokens,
        prompt_tokens=row.prompt_tokens,
        completion_tokens=row.completion_tokens,
        reasoning_tokens=row.reasoning_tokens,
        has_logprobs=bool(row.payload_hash) if row.has_logprobs is None else row.has_logprobs,
        system_fingerprint=row.system_fingerprint,
        response_model=row.response_model,
        headers=row.headers,
        error=row.error,
        error_kind=ErrorKind(row.error_kind) if row.error_kind else None,
        stack=stack,
    )


def _judged_against(s: Session, backend: str) -> tuple[Loaded, set[str]]:
    """Every baseline and calibration of a backend (four statements), and the content keys they show."""
    b, o, c = (t.__table__.c for t in (BaselineRow, ObservationRow, CalibrationRow))  # type: ignore[attr-defined]
    conn = s.connection()  # Core statements: a new store compiles each once, and the ORM's cost more
    q = select_core(b.observation_id, b.configuration).where(b.backend == backend)
    keys = dict(conn.execute(q).all())
    rows = conn.execute(select_core(ObservationRow.__table__).where(o.id.in_(list(keys)))).all()  # type: ignore[arg-type]
    baselines, known = {}, set()
    for row, obs in zip(rows, _observations(s, rows), strict=True):
        baselines[(row.canary_id, keys[row.id])] = Baseline(row.id, obs, row.correct)  # type: ignore[arg-type]
        known.update(h for h in (row.stack_hash, row.payload_hash, obs.request_ref) if h)
    q = select_core(c.canary_id, c.configuration, c.model).where(c.backend == backend)
    calibrations = {(cid, k): Doc(m) if isinstance(m, dict) else m for cid, k, m in conn.execute(q)}
    return Loaded(baselines, calibrations), known


class Queries(Connected):
    """The store's reads (a mixin of `canaryd.store.Store`)."""

    # -- what a new observation is judged against -----------------------------------------------------
    def baseline(self, backend: str, canary_id: str, configuration: str | None = None) -> Baseline | None:
        """The baseline observation (with its id and correctness) of a canary × backend under a serving
        configuration (None: the latest of any configuration), if any."""
        if configuration is None:
            return latest(self.baselines(backend, canary_id))
        with self._session() as s:
            b = s.get(BaselineRow, (backend, canary_id, configuration))
            if b is None:
                return None
            row = s.get(ObservationRow, b.observation_id)
            return Baseline(row.id, _to_observation(s, row), row.correct) if row else None  # type: ignore[arg-type]

    def baselines(self, backend: str, canary_id: str) -> dict[str, Baseline]:
        """The canary's baseline under each serving configuration it has one for."""
        with self._session() as s:
            q = select(BaselineRow.configuration, BaselineRow.observation_id).where(
                BaselineRow.backend == backend, BaselineRow.canary_id == canary_id
            )
            out = {}
            for configuration, oid in s.exec(q):
                row = s.get(ObservationRow, oid)
                if row is not None:
                    out[configuration] = Baseline(row.id, _to_observation(s, row), row.correct)  # type: ignore[arg-type]
            return out

    def judging(self, backend: str) -> Judging:
        """What a probe pass of ``backend`` judges against (`canaryd.store.cache`): its baselines and
        calibrations, from memory when the generation statement finds them unchanged."""
        with self._session() as s:
            seen = generation(s.connection())
            loaded = self._cache.current(backend, seen)
            if loaded is None:
                loaded, known = _judged_against(s, backend)
                self._cache.learn(known)
                self._cache.keep(backend, seen, loaded)
        return Judging(self, loaded)

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
            return _observations(s, list(s.exec(q.order_by(text("id")))))

    def configurations(self, backend: str) -> set[str]:
        """The configurations any of the backend's canaries has a baseline under."""
        with self._session() as s:
            q = select(BaselineRow.configuration).where(BaselineRow.backend == backend).distinct()
            return set(s.exec(q))

    def calibration(self, backend: str, canary_id: str, configuration: str | None = None) -> dict | None:
        """The stored noise model of a canary × backend × configuration (``NoiseModel.as_dict()``; None:
        that of the latest baseline's configuration), None if uncalibrated."""
        if configuration is None:
            configuration = latest_configuration(self.baselines(backend, canary_id)) or ""
        with self._session() as s:
            row = s.get(CalibrationRow, (backend, canary_id, configuration))
            return row.model if row else None

    # -- observations ---------------------------------------------------------------------------------
    def observations(
        self,
        *,
        backend: str | None = None,
        canary_id: str | None = None,
        instance: str | None = None,
        limit: int = 50,
    ) -> list[StoredObservation]:
        """Observations, newest first; ``instance`` narrows them to what one daemon of a fleet probed."""
        with self._session() as s:
            q = select(ObservationRow)
            if backend:
                q = q.where(ObservationRow.backend == backend)
            if canary_id:
                q = q.where(ObservationRow.canary_id == canary_id)
            if instance is not None:
                q = q.where(ObservationRow.instance == instance)
            rows = s.exec(q.order_by(ObservationRow.id.desc()).limit(limit))  # type: ignore[union-attr]
            return [_stored(row) for row in rows]

    def observation(self, obs_id: int) -> Observation | None:
        with self._session() as s:
            row = s.get(ObservationRow, obs_id)
            return _to_observation(s, row) if row else None

    def load(self, ids: Sequence[int]) -> list[tuple[StoredObservation, Observation]]:
        """Observations by id, as stored columns and full observations (tokens, stack), in id order."""
        with self._session() as s:
            rows = s.exec(select(ObservationRow).where(col(ObservationRow.id).in_(ids)).order_by(text("id")))
            return [(_stored(row), _to_observation(s, row)) for row in rows]

    def verdicts(self, backend: str, canary_id: str) -> Iterator[tuple[int, str]]:
        """(observation id, verdict) of one canary × backend, newest first, streamed (close it when done
        early: it holds a session)."""
        with self._session() as s:
            q = (
                select(ObservationRow.id, ObservationRow.verdict)
                .where(ObservationRow.backend == backend, ObservationRow.canary_id == canary_id)
                .order_by(text("id DESC"))
            )
            yield from s.exec(q.execution_options(yield_per=1000))  # type: ignore[misc]

    def canaries(self, backend: str) -> list[str]:
        """Every canary this backend was ever probed with, sorted."""
        with self._session() as s:
            q = select(OutcomeRow.canary_id).where(OutcomeRow.backend == backend).distinct()
            return sorted(s.exec(q))

    # -- runs -----------------------------------------------------------------------------------------
    def run(self, run_id: int) -> RunInfo | None:
        """One run (backend, instance, start and end), None when there is no such run."""
        with self._session() as s:
            row = s.get(RunRow, run_id)
            if row is None:
                return None
            return RunInfo(row.id, row.backend, row.instance, row.started_at, row.finished_at, row.canaries)  # type: ignore[arg-type]

    def run_ids(self, since: datetime) -> list[int]:
        """Runs started at or after ``since``, oldest first."""
        with self._session() as s:
            q = select(RunRow.id).where(RunRow.started_at >= since).order_by(text("id"))
            return list(s.exec(q))  # type: ignore[arg-type]

    def ids_of_runs(self, run_ids: Sequence[int]) -> list[int]:
        """The ids of every observation of these runs, in id order."""
        with self._session() as s:
            q = select(EventRow.id).where(col(EventRow.run_id).in_(run_ids)).order_by(text("id"))
            return list(s.exec(q))  # type: ignore[arg-type]

    # -- stacks ---------------------------------------------------------------------------------------
    def run_stacks(self, backend: str) -> list[RunStacks]:
        """The distinct stacks each run's observations showed, newest run first."""
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
            stack_fields: dict[str, dict] = {}
            for _, hashes in runs.values():
                for h in hashes - stack_fields.keys():
                    stack_fields[h] = s.get(StackRow, h).fields  # type: ignore[union-attr]
            return [
                RunStacks(run_id, started, tuple(stack_fields[h] for h in sorted(hashes)))
                for run_id, (started, hashes) in sorted(runs.items(), reverse=True)
            ]

    def stacks(self, backend: str | None = None) -> list[StackSeen]:
        """Each distinct stack of each backend, with when that backend first showed it; oldest first."""
        with self._session() as s:
            q = select(ObservationRow.backend, ObservationRow.stack_hash, ObservationRow.started_at).where(
                ObservationRow.stack_hash.is_not(None)  # type: ignore[union-attr]
            )
            if backend:
                q = q.where(ObservationRow.backend == backend)
            seen: dict[tuple[str, str], datetime] = {}
            for b, h, t in s.exec(q.order_by(ObservationRow.id)):  # type: ignore[arg-type]
                seen.setdefault((b, h), t)
            return [StackSeen(b, h, t, s.get(StackRow, h).fields) for (b, h), t in seen.items()]  # type: ignore[union-attr]

    # -- cost -----------------------------------------------------------------------------------------
    def spend(self, backend: str, since: datetime) -> tuple[int, int]:
        """(tokens, requests) a backend was sent since ``since``, by every instance (a fleet shares one
        budget). Tokens are prompt + completion: OpenAI counts reasoning tokens within completion_tokens.
        What was never sent (``not sent: ...``, a down backend's missing canaries) is no request."""
        o = ObservationRow.__table__.c  # type: ignore[attr-defined]
        tokens = func.coalesce(
            func.sum(func.coalesce(o.prompt_tokens, 0) + func.coalesce(o.completion_tokens, 0)), 0
        )
        sent = and_(o.request_hash != "", or_(o.error.is_(None), not_(o.error.like("not sent%"))))
        q = select_core(tokens, func.count()).where(o.backend == backend, o.started_at >= since, sent)
        with self._session() as s:
            spent, requests = s.connection().execute(q).one()
        return int(spent), int(requests)
