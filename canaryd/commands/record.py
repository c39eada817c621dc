"""``canaryd explain``, ``record``, ``prune`` and ``export``: what the store keeps, explained, recorded for a
session, pruned and exported (`canaryd.report.record`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from canaryd.commands import JsonFlag, commands, load, reader_of, store_of
from canaryd.errors import InputError

app = commands()


@app.command()
def explain(
    ctx: typer.Context,
    backend: Annotated[str, typer.Argument(help="The backend.")],
    canary: Annotated[
        str | None, typer.Argument(help="One canary (default: every canary that flipped).")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """The last flip: last good and first bad observation side by side, what moved, what to revert."""
    from canaryd.report.console import show_explain
    from canaryd.report.record import explain as explain_flips

    with reader_of(load(ctx)) as store:
        doc = explain_flips(store, backend, canary)
    show_explain(doc, as_json)


def _write(text: str, path: Path | None) -> None:
    if path is None:
        sys.stdout.write(text)
    else:
        from canaryd.files import write_private

        write_private(path, text)


@app.command("record")
def record_cmd(
    ctx: typer.Context,
    run: Annotated[
        list[int] | None, typer.Option("--run", metavar="RUN_ID", help="A run id (repeatable).")
    ] = None,
    since: Annotated[str | None, typer.Option(help="Every run since: ISO 8601 time or duration.")] = None,
    pin: Annotated[Path | None, typer.Option(help="Say whether the session matched this pin.")] = None,
    fmt: Annotated[str, typer.Option("--format", help="md or json.")] = "md",
    out_file: Annotated[Path | None, typer.Option("--out", help="Write here (default: stdout).")] = None,
    html: Annotated[Path | None, typer.Option("--html", help="Also write the HTML report here.")] = None,
) -> None:
    """The reproducibility record of a session, from the store: stack, pin, canaries, changes, pointers."""
    import json

    from canaryd.fields import since_time
    from canaryd.report.pin import load_pin
    from canaryd.report.record import record_of, to_markdown

    if (not run) == (since is None):
        raise InputError("record: give either --run ID (repeatable) or --since TIME")
    if fmt not in ("md", "json"):
        raise InputError(f"--format: {fmt!r} is not md or json")
    pinned = load_pin(pin) if pin is not None else None
    with reader_of(load(ctx)) as store:
        run_ids = run or store.run_ids(since_time(since))  # type: ignore[arg-type]
        rec = record_of(store, run_ids, since, pinned, str(pin or ""))
        if html is not None:
            from canaryd.report.html import write_report

            write_report(store, run_ids, html)
    _write(
        json.dumps(rec, indent=2, ensure_ascii=False) + "\n" if fmt == "json" else to_markdown(rec), out_file
    )


@app.command()
def prune(
    ctx: typer.Context,
    older_than: Annotated[str, typer.Option(help="Age, e.g. 30d or 12h.")],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Count what would go; delete nothing.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Delete observations older than the given age (never baselines, pinned or recorded ones)."""
    from datetime import UTC, datetime, timedelta

    from canaryd.fields import parse_duration
    from canaryd.report.console import show_pruned

    try:
        cutoff = datetime.now(UTC) - timedelta(seconds=parse_duration(older_than))
    except ValueError as e:
        raise InputError(f"--older-than: {e}") from None
    with reader_of(load(ctx)) if dry_run else store_of(load(ctx)) as store:
        counts = store.prune(cutoff, dry_run=dry_run)
    show_pruned(counts, cutoff, dry_run, as_json)


@app.command()
def export(
    ctx: typer.Context,
    run: Annotated[list[int], typer.Option("--run", metavar="RUN_ID", help="A run id (repeatable).")],
    out_file: Annotated[Path | None, typer.Option("--out", help="Write here (default: stdout).")] = None,
) -> None:
    """A run's raw observations as JSON lines: every field, tokens, logprobs, top-k and the stack."""
    from canaryd.report.record import export_lines

    with reader_of(load(ctx)) as store:
        _write(export_lines(store, run), out_file)
