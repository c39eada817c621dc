"""Human tables (rich) and machine JSON for probe results, history and stacks."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from rich.console import Console
from rich.table import Table

from canaryd.judge.compare import Verdict
from canaryd.probe.calibrate import Calibrated
from canaryd.probe.run import Result
from canaryd.store import ObservationRow

_STYLE = {
    Verdict.IDENTICAL: "green",
    Verdict.NOISE: "green",
    Verdict.BASELINE: "cyan",
    Verdict.STACK_CHANGE: "yellow",
    Verdict.LOGPROB_DRIFT: "yellow",
    Verdict.ANSWER_DRIFT: "red",
    Verdict.REGRESSION: "bold red",
    Verdict.ERROR: "magenta",
}


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
        "prompt_tokens": o.prompt_tokens,
        "completion_tokens": o.completion_tokens,
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
    for col in ("backend", "canary", "verdict", "correct", "1st div", "max |Δlp|", "fingerprint", "why"):
        t.add_column(col, overflow="fold")
    for group in _groups(results):
        r = group[0]
        c, d = r.comparison, r.comparison.delta
        moved = None if d is None else max(d.max_abs_dlogprob or 0.0, d.max_abs_dtop or 0.0)
        t.add_row(
            r.observation.backend,
            r.observation.canary_id + (f" ×{len(group)}" if len(group) > 1 else ""),
            f"[{_STYLE[c.verdict]}]{c.verdict.value}[/]",
            _correct(group),
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


def history_table(rows: Sequence[ObservationRow]) -> Table:
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
            f"[{_STYLE[Verdict(o.verdict)]}]{o.verdict}[/]",
            _tick(o.correct),
            (answer or "")[:60],
            o.stack_hash or "-",
        )
    return t


def print_tables(console: Console, *tables: Table | None) -> None:
    for t in tables:
        if t is not None:
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
