"""Human tables (rich) and machine JSON: probe results, pins, censuses, calibrations, run diffs, history.

Every rich table the CLI prints is built here; ``canaryd.report.console`` decides what goes where.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from canaryd.judge.verdicts import Verdict
from canaryd.stack import configuration_of

if TYPE_CHECKING:
    from canaryd.judge.census import Census
    from canaryd.probe.calibrate import Calibrated
    from canaryd.probe.run import Result
    from canaryd.report.pin import PinReport
    from canaryd.report.rundiff import PairDiff
    from canaryd.store import StoredObservation


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _tick(x: bool | None) -> str:
    return {True: "yes", False: "no", None: "-"}[x]


def result_dict(r: Result) -> dict:
    o = r.observation
    return {
        "observation_id": r.observation_id,
        "run_id": r.run_id,
        "backend": o.backend,
        "canary": o.canary_id,
        "suite": o.suite,
        "text": o.text,
        "latency_s": o.latency_s,
        "system_fingerprint": o.system_fingerprint,
        "configuration": configuration_of(o.stack) if o.ok else None,
        "prompt_tokens": o.prompt_tokens,
        "completion_tokens": o.completion_tokens,
        "reasoning_tokens": o.reasoning_tokens,
        "error": o.error,
        "error_kind": o.error_kind.value if o.error_kind else None,
        **r.comparison.as_dict(),
    }


def _groups(results: Sequence[Result]) -> Iterator[list[Result]]:
    """Consecutive results of one canary with one verdict and reasons: a sampled canary's n draws."""

    def key(r: Result) -> tuple:
        return (r.observation.backend, r.observation.canary_id, r.comparison.verdict, r.comparison.reasons)

    for _, group in itertools.groupby(results, key=key):
        yield list(group)


def _correct(group: Sequence[Result]) -> str:
    if len(group) == 1:
        return _tick(group[0].comparison.correct)
    judged = [r.comparison.correct for r in group if r.comparison.correct is not None]
    return f"{sum(judged)}/{len(judged)}" if judged else "-"


def results_table(results: Sequence[Result]) -> Table:
    """One row per canary result; a sampled canary's draws share one row (``id ×n``, correct as k/n)."""
    t = Table(title="canaryd check", title_justify="left")
    # basis: what the verdict rests on, "logprobs" or "text" (1st div then counts characters)
    cols = ("backend", "canary", "verdict", "correct", "basis", "1st div", "max |Δlp|", "fingerprint", "why")
    for col in cols:
        t.add_column(col, overflow="fold")
    for group in _groups(results):
        r = group[0]
        c, d = r.comparison, r.comparison.delta
        moved = (
            None if d is None or c.basis == "text" else max(d.max_abs_dlogprob or 0.0, d.max_abs_dtop or 0.0)
        )
        t.add_row(
            r.observation.backend,
            r.observation.canary_id + (f" ×{len(group)}" if len(group) > 1 else ""),
            f"[{c.verdict.style}]{c.verdict.value}[/]",
            _correct(group),
            c.basis,
            "-" if d is None or d.first_divergence is None else str(d.first_divergence),
            _num(moved),
            r.observation.system_fingerprint or "-",
            "; ".join(c.reasons),
        )
    return t


def stack_changes_table(results: Sequence[Result]) -> Table | None:
    """Distinct stack-field changes across the results, one row each (what on-call reads first)."""
    rows = {
        (r.observation.backend, ch.field, ch.before, ch.after)
        for r in results
        for ch in r.comparison.stack_changes
    }
    if not rows:
        return None
    t = Table(title="stack changes since baseline", title_justify="left")
    for col in ("backend", "field", "baseline", "now"):
        t.add_column(col, overflow="fold")
    for b, f, before, after in sorted(rows, key=lambda x: (x[0], x[1])):
        t.add_row(b, f, "(absent)" if before is None else before, "(absent)" if after is None else after)
    return t


def tokens_spent(o: StoredObservation) -> int | None:
    """Tokens the answer reported: prompt + completion (OpenAI counts reasoning within completion)."""
    if o.prompt_tokens is None and o.completion_tokens is None:
        return None
    return (o.prompt_tokens or 0) + (o.completion_tokens or 0)


def spent_table(spent: dict[str, tuple[int, int]]) -> Table | None:
    """Each backend's spend so far this UTC day (what its daily budget counts)."""
    if not spent:
        return None
    t = Table(title="spent today (UTC)", title_justify="left")
    for col in ("backend", "tokens", "requests"):
        t.add_column(col)
    for b, (tokens, requests) in spent.items():
        t.add_row(b, str(tokens), str(requests))
    return t


def history_table(rows: Sequence[StoredObservation]) -> Table:
    t = Table(title="history (newest first)", title_justify="left")
    for col in (
        "id",
        "run",
        "instance",
        "time (UTC)",
        "backend",
        "canary",
        "verdict",
        "correct",
        "tokens",
        "answer",
        "stack",
    ):
        t.add_column(col, overflow="fold")
    for o in rows:
        answer = o.text if o.error is None else f"[magenta]{o.error_kind}: {o.error}[/]"
        t.add_row(
            str(o.id),
            str(o.run_id),
            o.instance,
            o.started_at.strftime("%Y-%m-%d %H:%M:%S"),
            o.backend,
            o.canary_id,
            f"[{Verdict(o.verdict).style}]{o.verdict}[/]" + (" + refit" if _refit(o) else ""),
            _tick(o.correct),
            str(spent) if (spent := tokens_spent(o)) is not None else "-",
            (answer or "")[:60],
            o.stack_hash or "-",
        )
    return t


def _refit(o: StoredObservation) -> bool:
    """Whether the pass refit the canary's noise model (``canaryd.judge.living``)."""
    return "refit" in ((o.comparison or {}).get("evidence") or {}).get("detail", {})


def print_tables(console: Console, *tables: Table | None) -> None:
    """Print the tables; off a terminal (piped, a file) as plain columns without box drawing or colour."""
    for t in tables:
        if t is not None:
            if not console.is_terminal:
                t.box, t.show_edge = None, False
            console.print(t)


def calibration_table(results: Sequence[Calibrated]) -> Table:
    """One row per calibrated canary × backend: the noise floor in figures."""
    t = Table(title="canaryd baseline calibrate", title_justify="left")
    for col in (
        "backend",
        "canary",
        "k",
        "regime",
        "signatures",
        "completions",
        "|Δlp| p50/p99",
        "spread med/max",
        "threshold",
    ):
        t.add_column(col, overflow="fold")
    for r in results:
        if r.model is None:
            t.add_row(r.backend, r.canary_id, "-", "failed", "-", "-", "-", "-", r.problem or "")
            continue
        s = r.model.summary()
        t.add_row(
            r.backend,
            r.canary_id,
            str(s["k"]),
            s["regime"] + (" (not saved)" if r.problem else ""),
            str(s["signatures"]),
            str(s["completions"]),
            f"{_num(s['abs_dlogprob_p50'])} / {_num(s['abs_dlogprob_p99'])}",
            f"{_num(s['spread_median'])} / {_num(s['spread_max'])}",
            _num(s["threshold"]),
        )
    return t


def pin_table(report: PinReport) -> Table:
    """One row per pinned field that moved or is new, and per pinned backend that could not be reached."""
    t = Table(title="pin", title_justify="left")
    for col in ("backend", "field", "pinned", "now", "status"):
        t.add_column(col, overflow="fold")
    for f in report.fields:
        status = "new (not failing)" if not f.moved else ("gone" if f.now is None else "moved")
        t.add_row(f.backend, f.field, f.pinned or "(absent)", f.now or "(absent)", status)
    for b in report.unreachable:
        t.add_row(b, "-", "-", "-", "unreachable")
    for b, configuration in report.unpinned:
        t.add_row(b, "configuration", "(not pinned)", configuration or "(none)", "unpinned configuration")
    return t


def _histogram(h: dict[int, int], limit: int = 4) -> str:
    items = [f"{i}×{c}" for i, c in h.items()]
    return " ".join(items[:limit]) + (" …" if len(items) > limit else "") if items else "-"


def census_table(censuses: Sequence[Census]) -> Table:
    """One row per backend × canary × batch size."""
    t = Table(title="canaryd census", title_justify="left")
    cols = ("backend", "canary", "batch", "ok/n", "completions", "signatures", "modal", "1st div", "spread")
    for col in cols:
        t.add_column(col, overflow="fold")
    for c in censuses:
        for b, g in c.groups.items():
            t.add_row(
                c.backend,
                c.canary,
                str(b),
                f"{g.ok}/{g.n}",
                str(g.distinct_completions),
                str(g.distinct_signatures),
                str(g.modal_count),
                _histogram(g.first_divergence),
                f"{g.max_spread:.3g}",
            )
    return t


# -- run diffs (canaryd.report.rundiff) ------------------------------------------------------------------


def _points(p: float | None) -> str:
    return "-" if p is None else f"{p:+.1f} pt"


def _distinct(diff: PairDiff, key: str) -> str:
    x, y = diff.a[key], diff.b[key]
    return f"{len(x)} / {len(y)}" + ("" if not (x or y) else " (same)" if x == y else " (different)")


def diff_table(diffs: Iterable[PairDiff]) -> Table:
    """The seed study's table: one column per pair of runs (e.g. "Local", "API")."""
    diffs = list(diffs)
    t = Table(title="canaryd diff: run A → run B", title_justify="left")
    t.add_column("between two runs")
    for d in diffs:
        t.add_column(d.label, overflow="fold")

    def largest(d: PairDiff) -> str:
        top = d.largest_move
        return (
            "-"
            if top is None
            else f"{abs(top.points or 0):.1f} pt" + (f" ({top.suite})" if top.points else "")
        )

    rows = [
        ("runs", lambda d: f"{d.a['run_id']} → {d.b['run_id']}"),
        (
            "backend",
            lambda d: (
                d.a["backend"] if d.a["backend"] == d.b["backend"] else f"{d.a['backend']} → {d.b['backend']}"
            ),
        ),
        ("final answers that changed", lambda d: str(d.answers)),
        ("reasoning steps that changed", lambda d: str(d.steps)),
        ("questions with any step change", lambda d: str(d.questions)),
        ("answers correct → wrong", lambda d: str(len(d.to_wrong))),
        ("answers wrong → correct", lambda d: str(len(d.to_right))),
        ("largest score movement on one suite", largest),
        ("system fingerprints serving each run", lambda d: _distinct(d, "system_fingerprints")),
        ("serving configurations of each run", lambda d: _distinct(d, "configurations")),
        ("stacks serving each run", lambda d: _distinct(d, "stack_hashes")),
        ("canaries in one run only (A / B)", lambda d: f"{len(d.only_in_a)} / {len(d.only_in_b)}"),
    ]
    for name, cell in rows:
        t.add_row(name, *(cell(d) for d in diffs))
    return t


def scores_table(diffs: Iterable[PairDiff]) -> Table:
    """Score per suite in each run, and its movement (an unchanged score may hide changed answers)."""
    diffs = list(diffs)
    t = Table(title="scores per suite: run A → run B", title_justify="left")
    t.add_column("suite")
    for d in diffs:
        t.add_column(d.label, overflow="fold")
    suites = sorted({s.suite for d in diffs for s in d.suites})
    for suite in suites:
        cells = []
        for d in diffs:
            s = next((s for s in d.suites if s.suite == suite), None)
            cells.append("-" if s is None else f"{s.a or '-'} → {s.b or '-'}, {_points(s.points)}")
        t.add_row(suite, *cells)
    return t
