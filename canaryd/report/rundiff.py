"""Two runs of the same canaries, diffed answer by answer and step by step (``canaryd diff``).

A run is one pass of a backend's canaries. A *question* is a canary; its *steps* are its observations in the
order sent (one for a plain canary, one per step of a chained canary, ``id:step``) and its *final answer*
is its last step. A step changed when its token ids (the tokens, where the server gave no ids) or its text
differ between the runs. A sampled canary's n draws are its steps by occurrence (draw i against draw i:
meaningful with pinned seeds; ``canaryd check`` tests the draws as distributions). A score is per suite:
final answers that passed ``expect`` over those judged.

Counting every step and every answer, not totals, is the point: a score can hold still while answers move
in opposite directions (one gained, one lost), and answers can hold while the reasoning under them moves.
Observations with an error in either run are counted apart, never as changes. Pure functions: the CLI
reads the runs from the store, and ``canaryd.report.tables`` and ``canaryd.report.console`` render the diffs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from canaryd.errors import InputError
from canaryd.observation import Observation
from canaryd.stack import configuration_of
from canaryd.store import Store, StoredObservation


@dataclass(frozen=True, slots=True)
class StepOutput:
    """One observation, reduced to what a run diff compares."""

    canary_id: str  # "q" for a plain canary, "q:step" for a step of a chained one
    suite: str
    text: str | None
    tokens: tuple[int | str, ...]
    correct: bool | None
    error: str | None = None
    fingerprint: str | None = None
    stack_hash: str | None = None
    configuration: str = ""  # `canaryd.stack.configuration_of` its stack ("" none named)

    @property
    def question(self) -> str:
        return self.canary_id.partition(":")[0]

    @property
    def ok(self) -> bool:
        return self.error is None


def step_output(row: StoredObservation, obs: Observation) -> StepOutput:
    ids = [t.token_id for t in obs.tokens]
    return StepOutput(
        canary_id=row.canary_id,
        suite=row.suite,
        text=row.text,
        tokens=tuple(t.token_id if None not in ids else t.token for t in obs.tokens),
        correct=row.correct,
        error=row.error,
        fingerprint=row.system_fingerprint,
        stack_hash=row.stack_hash,
        configuration=configuration_of(obs.stack),
    )


@dataclass(frozen=True, slots=True)
class Run:
    run_id: int
    backend: str
    started_at: datetime
    steps: tuple[StepOutput, ...]  # in the order sent

    def questions(self) -> dict[str, dict[tuple[str, int], StepOutput]]:
        """Question → its steps keyed by (canary id, occurrence), in the order sent (the last is final)."""
        out: dict[str, dict[tuple[str, int], StepOutput]] = {}
        for s in self.steps:
            steps = out.setdefault(s.question, {})
            steps[(s.canary_id, sum(k[0] == s.canary_id for k in steps))] = s
        return out

    def scores(self) -> dict[str, Score]:
        """Per suite: final answers correct / judged (judged: answered, and the canary has an ``expect``)."""
        tally: dict[str, list[int]] = {}
        for steps in self.questions().values():
            final = list(steps.values())[-1]
            t = tally.setdefault(final.suite, [0, 0])
            if final.ok and final.correct is not None:
                t[0] += final.correct
                t[1] += 1
        return {suite: Score(c, n) for suite, (c, n) in sorted(tally.items())}

    def summary(self) -> dict:
        ok = [s for s in self.steps if s.ok]
        return {
            "run_id": self.run_id,
            "backend": self.backend,
            "started_at": self.started_at.isoformat(),
            "questions": len(self.questions()),
            "steps": len(self.steps),
            "errors": len(self.steps) - len(ok),
            "system_fingerprints": sorted({s.fingerprint for s in ok if s.fingerprint is not None}),
            "stack_hashes": sorted({s.stack_hash for s in ok if s.stack_hash is not None}),
            # the serving configurations that answered (empty: none named; see docs/fleets.md)
            "configurations": sorted({s.configuration for s in ok if s.configuration}),
        }


@dataclass(frozen=True, slots=True)
class Score:
    correct: int
    judged: int

    @property
    def percent(self) -> float | None:
        return 100.0 * self.correct / self.judged if self.judged else None

    def __str__(self) -> str:
        return "-" if self.percent is None else f"{self.correct}/{self.judged} ({self.percent:.0f}%)"


@dataclass(frozen=True, slots=True)
class Count:
    changed: int
    compared: int  # answered in both runs (a question: at least one of its steps)
    errors: int  # an error in either run, not compared (a question: in at least one of its steps)

    def as_dict(self) -> dict:
        return {"changed": self.changed, "compared": self.compared, "errors": self.errors}

    def __str__(self) -> str:
        errors = f" ({self.errors} error{'s' if self.errors > 1 else ''})" if self.errors else ""
        return f"{self.changed} / {self.compared}{errors}"


@dataclass(frozen=True, slots=True)
class SuiteScore:
    suite: str
    a: Score | None  # None: the suite is not in that run
    b: Score | None

    @property
    def points(self) -> float | None:
        """The score's movement from run A to run B, in percentage points."""
        if self.a is None or self.b is None or self.a.percent is None or self.b.percent is None:
            return None
        return self.b.percent - self.a.percent


@dataclass(frozen=True, slots=True)
class PairDiff:
    label: str
    a: dict  # Run.summary() of each run
    b: dict
    answers: Count
    steps: Count
    questions: Count
    changed_answers: tuple[str, ...]  # questions whose final answer changed
    first_changed_step: dict[str, str]  # question → canary id of its first changed step
    to_wrong: tuple[str, ...]
    to_right: tuple[str, ...]
    suites: tuple[SuiteScore, ...]
    only_in_a: tuple[str, ...]  # questions (or steps of shared questions) present in one run only
    only_in_b: tuple[str, ...]

    @property
    def changed(self) -> bool:
        return self.steps.changed > 0  # a final answer is a step too

    @property
    def largest_move(self) -> SuiteScore | None:
        moved = [s for s in self.suites if s.points is not None]
        return max(moved, key=lambda s: abs(s.points), default=None)  # type: ignore[arg-type]

    def as_dict(self) -> dict:
        top = self.largest_move
        return {
            "label": self.label,
            "run_a": self.a,
            "run_b": self.b,
            "changed": self.changed,
            "final_answers": {**self.answers.as_dict(), "questions": list(self.changed_answers)},
            "steps": self.steps.as_dict(),
            "questions": {**self.questions.as_dict(), "first_changed_step": self.first_changed_step},
            "flips": {"correct_to_wrong": list(self.to_wrong), "wrong_to_correct": list(self.to_right)},
            "scores": [
                {
                    "suite": s.suite,
                    "a": None if s.a is None else {"correct": s.a.correct, "judged": s.a.judged},
                    "b": None if s.b is None else {"correct": s.b.correct, "judged": s.b.judged},
                    "a_percent": None if s.a is None else s.a.percent,
                    "b_percent": None if s.b is None else s.b.percent,
                    "movement_points": s.points,
                }
                for s in self.suites
            ],
            "largest_score_movement": None if top is None else {"suite": top.suite, "points": top.points},
            "only_in_a": list(self.only_in_a),
            "only_in_b": list(self.only_in_b),
        }


def _same(x: StepOutput, y: StepOutput) -> bool:
    return x.tokens == y.tokens and x.text == y.text


def _only(mine: dict, theirs: dict) -> tuple[str, ...]:
    whole = sorted(mine.keys() - theirs.keys())
    parts = sorted({cid for q in mine.keys() & theirs.keys() for cid, _ in mine[q].keys() - theirs[q].keys()})
    return (*whole, *parts)


def diff_runs(a: Run, b: Run, label: str = "") -> PairDiff:
    """Run B against run A: what changed, step by step and answer by answer, and what it did to scores."""
    qa, qb = a.questions(), b.questions()
    shared = [q for q in qa if q in qb]
    steps, answers, questions = [0, 0, 0], [0, 0, 0], [0, 0, 0]  # changed, compared, errors
    changed_answers: list[str] = []
    first_changed: dict[str, str] = {}
    to_wrong: list[str] = []
    to_right: list[str] = []
    for q in shared:
        compared = errored = False
        for k in (k for k in qa[q] if k in qb[q]):
            x, y = qa[q][k], qb[q][k]
            if not (x.ok and y.ok):
                steps[2] += 1
                errored = True
                continue
            steps[1] += 1
            compared = True
            if not _same(x, y):
                steps[0] += 1
                first_changed.setdefault(q, k[0])
        questions[0] += q in first_changed
        questions[1] += compared
        questions[2] += errored
        last_a, last_b = list(qa[q])[-1], list(qb[q])[-1]
        if last_a != last_b:
            continue  # the plans differ (see only_in_a/b): no final answer to compare
        x, y = qa[q][last_a], qb[q][last_b]
        if not (x.ok and y.ok):
            answers[2] += 1
            continue
        answers[1] += 1
        if not _same(x, y):
            answers[0] += 1
            changed_answers.append(q)
        if x.correct is True and y.correct is False:
            to_wrong.append(q)
        elif x.correct is False and y.correct is True:
            to_right.append(q)
    sa, sb = a.scores(), b.scores()
    suites = tuple(SuiteScore(s, sa.get(s), sb.get(s)) for s in sorted(sa.keys() | sb.keys()))
    return PairDiff(
        label=label or f"{a.run_id} → {b.run_id}",
        a=a.summary(),
        b=b.summary(),
        answers=Count(*answers),
        steps=Count(*steps),
        questions=Count(*questions),
        changed_answers=tuple(changed_answers),
        first_changed_step=first_changed,
        to_wrong=tuple(to_wrong),
        to_right=tuple(to_right),
        suites=suites,
        only_in_a=_only(qa, qb),
        only_in_b=_only(qb, qa),
    )


def pairs_of(run_ids: Sequence[int]) -> list[tuple[int, int]]:
    """``A B C D`` → ``[(A, B), (C, D)]``; an odd count is a usage error (the caller raises)."""
    return list(zip(run_ids[::2], run_ids[1::2], strict=True))


def diff_pairs(store: Store, runs: Sequence[int], labels: Sequence[str] | None = None) -> list[PairDiff]:
    """Each pair (A B, C D, …) of stored runs diffed, labelled in order; an unknown run is an InputError."""
    loaded: dict[int, Run] = {}
    for rid in dict.fromkeys(runs):
        info = store.run(rid)
        if info is None:
            raise InputError(f"diff: no run {rid} in {store.url}")
        stored = store.load(store.ids_of_runs([rid]))
        loaded[rid] = Run(rid, info.backend, info.started_at, tuple(step_output(r, o) for r, o in stored))
    return [
        diff_runs(loaded[a], loaded[b], labels[i] if labels else "")
        for i, (a, b) in enumerate(pairs_of(runs))
    ]
