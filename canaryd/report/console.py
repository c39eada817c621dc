"""What the CLI prints for each report object: rich tables and lines, or the ``--json`` document.

Tables go to the given console (stdout, or stderr for ``preflight``, whose stdout is the benchmark's);
one-line warnings and errors go to stderr. The exit code is the report's, never decided here.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Collection, Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from canaryd.errors import EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE
from canaryd.files import write_private
from canaryd.report.configurations import unchecked
from canaryd.report.tables import (
    calibration_table,
    census_table,
    diff_table,
    history_table,
    pin_table,
    print_tables,
    results_table,
    scores_table,
    spent_table,
    stack_changes_table,
    tokens_spent,
)
from canaryd.stack import diff, split

if TYPE_CHECKING:
    from canaryd.probe.calibrate import CalibrationReport
    from canaryd.probe.census import CensusReport
    from canaryd.probe.preflight import PassCheck, PinTaken, PreflightReport
    from canaryd.report.rundiff import PairDiff
    from canaryd.store import Accepted, StackSeen, StoredObservation


def _err(line: str) -> None:
    print(line, file=sys.stderr)


def show_pass(check: PassCheck, as_json: bool, console: Console, exit_code: int | None = None) -> None:
    """A probe pass (``check``, ``probe``, ``preflight``) and its pin check, as tables or JSON (whose
    ``exit_code`` is the command's: ``probe`` exits 0 on drift); the first backend failure on stderr."""
    if as_json:
        doc = check.as_dict()
        if exit_code is not None:
            doc["exit_code"] = exit_code
        print(json.dumps(doc, indent=2))
        return
    print_tables(console, results_table(check.results), stack_changes_table(check.results))
    for seen in check.configurations:
        console.print(seen.describe(), highlight=False, soft_wrap=True)
    pin = check.pin
    if pin is not None:
        if pin.fields or pin.unreachable or pin.unpinned:
            print_tables(console, pin_table(pin))
        verdict = "matches" if pin.matches else f"{len(pin.moved)} field(s) moved"
        if pin.unpinned:
            verdict += f", {len(pin.unpinned)} configuration(s) not in the pin served"
        if pin.unreachable:
            verdict = f"cannot be confirmed ({', '.join(pin.unreachable)} unreachable)"
        console.print(f"pin {pin.path}: {verdict}", highlight=False, soft_wrap=True)
    for line in check.too_many:  # one line each: the backend and the configurations that served it
        _err(f"canaryd: {line}")
    for line in unchecked(check.configurations, check.max_configurations):
        _err(f"canaryd: note: {line}")
    refused = check.config_errors
    for line in refused:  # one line each: the backend, the parameter, the profile key that fixes it
        _err(f"canaryd: config error: {line}")
    bad = check.first_error
    if bad is not None and not refused:
        _err(f"canaryd: backend {bad.backend!r} canary {bad.canary_id!r}: {bad.error}")


def show_pin(taken: PinTaken, out_file: Path | None) -> None:
    """The pin file on stdout, or written to ``out_file`` with a line per pinned backend; a failure that
    left nothing pinned, and drifted canaries, on stderr."""
    from canaryd.report.pin import to_json

    pinned, bad = taken.pin, taken.failed
    if pinned is None:
        if bad is not None:
            _err(f"canaryd: pin: backend {bad.backend!r} failed ({bad.error}): nothing pinned")
        return
    if taken.drifted:
        _err(f"canaryd: pin: note: {taken.drifted} canaries drifted from their baselines")
    if out_file is None:
        sys.stdout.write(to_json(pinned))
        return
    write_private(out_file, to_json(pinned))
    for name, b in pinned.backends.items():
        print(f"{out_file}: pinned {name} ({b.kind}): {len(b.fields)} fields, run {b.run_id}")


def show_preflight(report: PreflightReport) -> None:
    """Why ``preflight`` did not start the command, or where its record went (stderr: stdout is COMMAND's).
    The pass's tables were printed before the command started (`show_pass`)."""
    program = report.command[0]
    if report.refused:
        why = {
            EXIT_UNAVAILABLE: "a backend was unreachable or failing",
            EXIT_USAGE: "a backend refuses the request as configured",
        }.get(report.check.exit_code, "the stack or the canaries moved")
        _err(f"canaryd: preflight: {why} (see above): not starting {program!r}")
        return
    if report.start_error is not None:
        _err(f"canaryd: preflight: cannot start {program!r}: {report.start_error}")
        return
    if report.held is False:
        _err("canaryd: preflight: warning: the stack or canaries moved while the command ran")
    _err(f"canaryd: preflight: record in {report.record_path} (and .json)")


def show_census(report: CensusReport, as_json: bool, console: Console, output: Path | None = None) -> None:
    """What could not be measured on stderr; then the census table and a verdict per canary, or JSON (and
    the JSON in ``output`` too, when given)."""
    if output is not None:
        write_private(output, json.dumps(report.as_dict(), indent=2, ensure_ascii=False) + "\n")
    for name, why in report.unavailable.items():
        _err(f"canaryd: census: backend {name!r} unreachable: {why}")
    for c in report.incomplete:
        _err(f"canaryd: census: {c.backend} {c.canary}: every probe of a batch size failed")
    if as_json:
        print(json.dumps(report.as_dict(), indent=2, ensure_ascii=False))
        return
    if report.censuses:
        print_tables(console, census_table(report.censuses))
    for c in report.censuses:
        console.print(f"{c.backend} {c.canary}: {c.verdict()}", highlight=False, soft_wrap=True)


def show_calibration(report: CalibrationReport, as_json: bool, console: Console) -> None:
    """Unreachable backends on stderr; then the noise table and each unsaved model's reason, or JSON."""
    for name, why in report.unavailable.items():
        _err(f"canaryd: baseline calibrate: backend {name!r} unreachable: {why}")
    if as_json:
        print(json.dumps(report.as_dict(), indent=2))
        return
    print_tables(console, calibration_table(report.results))
    for r in report.problems:
        _err(f"canaryd: backend {r.backend!r} canary {r.canary_id!r}: {r.problem}")


def show_stacks(stacks: Sequence[StackSeen], as_json: bool, console: Console) -> None:
    """Each backend's first stack in full, then each later one as the fields that changed."""
    if as_json:
        print(json.dumps({"exit_code": EXIT_OK, "stacks": [s.as_dict() for s in stacks]}, indent=2))
        return
    previous: dict[str, dict] = {}
    for s in stacks:
        console.print(
            f"[bold]{s.backend}[/] stack [cyan]{s.hash}[/] first seen {s.first_seen:%Y-%m-%d %H:%M:%S} UTC"
        )
        if s.backend not in previous:
            for k in sorted(s.fields):
                console.print(f"  {k} = {s.fields[k]}", highlight=False)
        else:
            recorded = split(previous[s.backend], s.fields)[1]
            for c in diff(previous[s.backend], s.fields):
                note = " (recorded differently by canaryd, not the server)" if c in recorded else ""
                console.print(f"  {c.field}: {c.before} -> {c.after}{note}", highlight=False)
        previous[s.backend] = s.fields


def changed_lines(diffs: Iterable[PairDiff], limit: int = 10) -> list[str]:
    """One line per pair naming the questions that changed and the step where each first changed."""
    lines = []
    for d in diffs:
        if not d.first_changed_step:
            continue
        named = [
            q if step == q else f"{q} (from {step.partition(':')[2]})"
            for q, step in list(d.first_changed_step.items())[:limit]
        ]
        more = len(d.first_changed_step) - limit
        lines.append(f"{d.label}: changed: {', '.join(named)}" + (f" and {more} more" if more > 0 else ""))
    return lines


def show_diff(diffs: Sequence[PairDiff], exit_code: int, as_json: bool, console: Console) -> None:
    """``canaryd diff``: the run-diff and per-suite score tables and what changed, or JSON."""
    if as_json:
        doc = {"exit_code": exit_code, "pairs": [d.as_dict() for d in diffs]}
        print(json.dumps(doc, indent=2, ensure_ascii=False))
        return
    print_tables(console, diff_table(diffs), scores_table(diffs))
    for line in changed_lines(diffs):
        console.print(line, highlight=False, soft_wrap=True)


def show_history(
    rows: Sequence[StoredObservation],
    as_json: bool,
    console: Console,
    spent: dict[str, tuple[int, int]] | None = None,
) -> None:
    """Stored observations, newest first, with their tokens, and each backend's spend this UTC day: tables,
    or every column as JSON."""
    spent = spent or {}
    if as_json:
        observations = [{**r.as_dict(), "tokens": tokens_spent(r)} for r in rows]
        today = {b: {"tokens": t, "requests": n} for b, (t, n) in spent.items()}
        doc = {"exit_code": EXIT_OK, "observations": observations, "spent_today": today}
        print(json.dumps(doc, indent=2))
    else:
        print_tables(console, history_table(rows), spent_table(spent))


def show_explain(doc: dict, as_json: bool) -> None:
    """``canaryd explain``: the flips as text, or the document as JSON."""
    from canaryd.report.record import explain_text

    if as_json:
        print(json.dumps({"exit_code": EXIT_OK, **doc}, indent=2, ensure_ascii=False))
    else:
        sys.stdout.write(explain_text(doc))


def show_accepted(accepted: Sequence[Accepted], dropped: int, as_json: bool = False) -> None:
    """A line per new baseline, and one for the calibrations dropped with the old ones (or JSON; none
    accepted is an error the CLI reports)."""
    if as_json:
        if accepted:
            rows = [
                {
                    "backend": a.backend,
                    "canary": a.canary_id,
                    "configuration": a.configuration,
                    "observation_id": a.observation_id,
                }
                for a in accepted
            ]
            print(
                json.dumps(
                    {"exit_code": EXIT_OK, "accepted": rows, "calibrations_dropped": dropped}, indent=2
                )
            )
        return
    for a in accepted:
        under = f" (configuration {a.configuration})" if a.configuration else ""
        print(f"{a.backend} {a.canary_id}{under}: baseline is now observation {a.observation_id}")
    if dropped:
        print(f"{dropped} calibration(s) dropped with the old baselines: run `canaryd baseline calibrate`")


def show_pruned(counts: dict[str, int], cutoff: datetime, dry_run: bool, as_json: bool = False) -> None:
    """One line: the observations deleted (or that would be), then the rows that went with them; or JSON."""
    if as_json:
        doc = {"exit_code": EXIT_OK, "dry_run": dry_run, "cutoff": cutoff.isoformat(), "deleted": counts}
        print(json.dumps(doc, indent=2))
        return
    rest = ", ".join(f"{n} {table}" for table, n in counts.items() if table != "observation")
    verb = "would delete" if dry_run else "deleted"
    print(
        f"{verb} {counts['observation']} observations started before {cutoff:%Y-%m-%dT%H:%M:%SZ}; then {rest}"
    )


def show_migration(where: str, before: str | None, after: str, as_json: bool = False) -> None:
    """``canaryd db upgrade``: what the migration did."""
    if as_json:
        print(
            json.dumps({"exit_code": EXIT_OK, "database": where, "before": before, "after": after}, indent=2)
        )
    elif before is None:
        print(f"{where}: created the schema at revision {after} (head)")
    elif before == after:
        print(f"{where}: at revision {after} (head): nothing to do")
    else:
        print(f"{where}: upgraded from revision {before} to {after} (head)")


def show_revision(rev: str | None, head: str, known: Collection[str], json_exit: int | None = None) -> None:
    """``canaryd db current``: the database's revision, and what to do when it is not ``head``; with
    ``json_exit`` (the exit code), the ``--json`` envelope instead."""
    if json_exit is not None:
        state = (
            "head" if rev == head else "empty" if rev is None else "newer" if rev not in known else "behind"
        )
        print(json.dumps({"exit_code": json_exit, "revision": rev, "head": head, "state": state}, indent=2))
    elif rev == head:
        print(f"{rev} (head)")
    elif rev is None:
        print(f"none: an empty database (head is {head}; run `canaryd db upgrade`)")
    elif rev not in known:
        print(f"{rev}: newer than this canaryd (head {head}): upgrade canaryd")
    else:
        print(f"{rev} (head is {head}; run `canaryd db upgrade`)")
