"""The store's record of probing: runs and their observations.

Every write is one transaction, and all of them are safe with other writers on the same database: several
daemons (distinct instance names) may write one PostgreSQL database at once, and the daemon and the CLI
share a SQLite file. Content-addressed rows (stack, payload, request, outcome) are inserted with ON
CONFLICT DO NOTHING, so identical content from two writers is one row and never an error. An observation
that is its configuration's first becomes its baseline in the same transaction (``baselines``); the other
writes of what judging reads are there too, and retention is in ``maintenance``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import structlog
from sqlalchemy import bindparam, update
from sqlmodel import Session, SQLModel, select

from canaryd.observation import Observation, canonical_digest, utcnow
from canaryd.stack import stack_hash as hash_of
from canaryd.store.baselines import first_baseline
from canaryd.store.engine import Connected, insert_ignore, insert_new
from canaryd.store.records import ComparisonLike
from canaryd.store.schema import (
    PAYLOAD_FORMAT,
    EventRow,
    OutcomeRow,
    PayloadRow,
    RequestRow,
    RunRow,
    StackRow,
    compress_payload,
    payload_key,
)

# Verdicts whose observation becomes its configuration's baseline: the first one, and the first of a
# configuration new to a canary that has baselines under others.
FIRST_OF_CONFIGURATION = ("baseline", "new-configuration")
# a verdict given whether or not a baseline existed: becomes one only where none did (of its request)
DETERMINISM_BROKEN = "determinism-broken"


Written = tuple[Observation, ComparisonLike, "int | None"]  # what `Writes.record` takes per observation


class Known(NamedTuple):
    """What a write takes as existing without a look-up: content keys, and outcome hashes with their ids."""

    keys: set[str]
    outcomes: dict[str, int]


log = structlog.get_logger("canaryd.store")


# Look-ups of content-addressed rows by hash, built once (building a statement costs more than running it).
_BY_HASH = {
    t.__tablename__: select(t.__table__.c.id if t is OutcomeRow else t.__table__.c.hash).where(  # type: ignore[attr-defined]
        t.__table__.c.hash == bindparam("key")  # type: ignore[attr-defined]
    )
    for t in (StackRow, PayloadRow, RequestRow, OutcomeRow)
}

_EVENT = EventRow.__table__.insert()  # type: ignore[attr-defined]
_RUN = RunRow.__table__.insert()  # type: ignore[attr-defined]


class Writes(Connected):
    """The store's writes (a mixin of `canaryd.store.Store`, which sets these attributes)."""

    instance: str  # recorded on every run this store starts

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
        found: dict[str, int] = {}
        with self._session() as s:
            item = (obs, comparison, baseline_id)
            event_id = self._write(s, run_id, item, Known(set(), {}), learned, found)
            s.commit()
        self._cache.learn(learned, found)
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
        found: dict[str, int] = {}
        known = Known(self._cache.known, self._cache.outcomes)
        try:
            with self._session() as s:
                ids: list[int | Exception] = [
                    self._write(s, run_id, item, known, learned, found) for item in items
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
        self._cache.learn(learned, found)
        return ids

    def _write(
        self, s: Session, run_id: int, item: Written, known: Known, learned: set[str], found: dict[str, int]
    ) -> int:
        """One observation into ``s``; what it shares with earlier ones is stored once.

        The stack, payload, request and outcome are content-addressed, so an identical repeat adds one
        ``event`` row (time, latency and its evidence, headers) and nothing else. A key in ``known``
        exists; any other is looked up (the common case: it exists, and nothing is sent or locked) and
        otherwise inserted with ON CONFLICT DO NOTHING, so a concurrent writer of the same content is no
        error. Keys now known to exist go to ``learned``, outcomes' with their ids to ``found``.
        """
        obs, comparison, baseline_id = item
        verdict = str(comparison.verdict.value)
        judged = comparison.as_dict()
        # A calibrated latency's evidence is this probe's alone: on the event, so that a repeat's outcome is
        # the same row (the view's reader puts it back, `queries._stored`).
        latency = judged.get("latency")
        if latency is not None:
            judged = {**judged, "latency": None}
        stack_hash = None
        if obs.stack:
            stack_hash = hash_of(obs.stack)
            if stack_hash not in known.keys and not self._exists(s, StackRow, stack_hash):
                insert_ignore(s, StackRow, hash=stack_hash, fields=obs.stack, first_seen=obs.started_at)
            learned.add(stack_hash)
        payload_hash = None
        if obs.tokens:
            payload_hash, canonical = payload_key(obs.tokens)
            if payload_hash not in known.keys and not self._exists(s, PayloadRow, payload_hash):
                data = compress_payload(canonical)
                insert_ignore(s, PayloadRow, hash=payload_hash, format=PAYLOAD_FORMAT, data=data)
            learned.add(payload_hash)
        ref = obs.request_ref
        if ref not in known.keys and not self._exists(s, RequestRow, ref):
            insert_ignore(s, RequestRow, hash=ref, body=obs.request)
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
            "comparison": judged,
            "baseline_id": baseline_id,
        }
        outcome_hash = canonical_digest(fields)
        by_hash = _BY_HASH["outcome"], {"key": outcome_hash}
        outcome_id = known.outcomes.get(outcome_hash) or found.get(outcome_hash)
        if outcome_id is None:  # usually new content: inserted first, looked up only if it was there
            outcome_id = insert_new(s, OutcomeRow, hash=outcome_hash, **fields)
        if outcome_id is None:  # an earlier pass's, or a concurrent writer's (committed: our insert waited)
            outcome_id = s.connection().execute(*by_hash).scalar_one()
        found[outcome_hash] = outcome_id
        event = {
            "run_id": run_id,
            "outcome_id": outcome_id,
            "started_at": obs.started_at,
            "latency_s": obs.latency_s,
            "headers": obs.headers,
            "latency_evidence": latency,
        }
        event_id = s.connection().execute(_EVENT, event).inserted_primary_key[0]
        if verdict in FIRST_OF_CONFIGURATION:
            first_baseline(s, obs, event_id, baseline_id)
        elif verdict == DETERMINISM_BROKEN and obs.ok:  # found at first contact: maybe the first answer
            first_baseline(s, obs, event_id, None)
        return event_id

    @staticmethod
    def _exists(s: Session, table: type[SQLModel], key: str) -> bool:
        return s.connection().execute(_BY_HASH[table.__tablename__], {"key": key}).first() is not None
