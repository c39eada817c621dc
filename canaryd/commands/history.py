"""``canaryd diff``, ``history`` and ``stack``: the stored runs, observations and stacks, side by side."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from canaryd.commands import JsonFlag, commands, console, load, reader_of
from canaryd.errors import EXIT_DRIFT, EXIT_OK, InputError

app = commands()


@app.command("diff")
def diff_cmd(
    ctx: typer.Context,
    runs: Annotated[
        list[int],
        typer.Argument(
            metavar="RUN_A RUN_B", help="Run ids in pairs, A B [C D ...] (`check --json` shows run_id)."
        ),
    ],
    label: Annotated[
        list[str] | None,
        typer.Option("--label", metavar="LABEL", help="A column name per pair, in order (repeatable)."),
    ] = None,
    as_json: JsonFlag = False,
    html: Annotated[Path | None, typer.Option("--html", help="Also write the HTML report here.")] = None,
) -> None:
    """Diff runs answer by answer and step by step: changes, flips, scores per suite, fingerprints, stacks.

    Exit 0 when no answer or step changed in any pair, 1 when one did (like diff(1)).
    """
    from canaryd.report.console import show_diff
    from canaryd.report.rundiff import diff_pairs

    if len(runs) % 2:
        raise InputError(f"diff: run ids come in pairs (A B [C D ...]), got {len(runs)}")
    if label and len(label) != len(runs) // 2:
        raise InputError(f"--label: {len(label)} label(s) for {len(runs) // 2} pair(s) of runs")
    with reader_of(load(ctx)) as store:
        diffs = diff_pairs(store, runs, label)
        if html is not None:
            from canaryd.report.html import write_report
            from canaryd.report.rundiff import pairs_of

            write_report(store, runs, html, pairs_of(runs), label)
    code = EXIT_DRIFT if any(d.changed for d in diffs) else EXIT_OK
    show_diff(diffs, code, as_json, console())
    raise typer.Exit(code)


@app.command()
def history(
    ctx: typer.Context,
    backend: Annotated[str | None, typer.Option(help="Only this backend.")] = None,
    canary: Annotated[str | None, typer.Option(help="Only this canary.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=100000, help="At most this many.")] = 50,
    as_json: JsonFlag = False,
) -> None:
    """Stored observations, newest first, with the tokens each cost and each backend's spend today."""
    from canaryd.probe.budget import day_start
    from canaryd.report.console import show_history

    with reader_of(load(ctx)) as store:
        rows = store.observations(backend=backend, canary_id=canary, limit=limit)
        names = dict.fromkeys(r.backend for r in rows)
        spent = {b: store.spend(b, day_start()) for b in names}
    show_history(rows, as_json, console(), spent)


@app.command()
def stack(
    ctx: typer.Context,
    backend: Annotated[str | None, typer.Option(help="Only this backend.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Every distinct serving stack each backend has shown, and what changed between them."""
    from canaryd.report.console import show_stacks

    with reader_of(load(ctx)) as store:
        stacks = store.stacks(backend)
    show_stacks(stacks, as_json, console())
