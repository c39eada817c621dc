"""``canaryd report``: one self-contained HTML file for a set of runs (see `canaryd.report.html`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from canaryd.commands import JsonFlag, commands, emit, load, reader_of
from canaryd.errors import EXIT_OK

app = commands()


@app.command()
def report(
    ctx: typer.Context,
    runs: Annotated[list[int], typer.Argument(help="Run ids: each diffed against the one before.")],
    out_file: Annotated[Path, typer.Option("--out", help="The HTML file.")] = Path("canaryd-report.html"),
    as_json: JsonFlag = False,
) -> None:
    """One self-contained HTML file (no server, no network): summary, token diffs, history, stack, record."""
    from canaryd.report.html import write_report

    with reader_of(load(ctx)) as store:
        size = write_report(store, runs, out_file)
    if as_json:
        emit({"exit_code": EXIT_OK, "path": str(out_file), "bytes": size})
        return
    print(f"{out_file}: {size} bytes")
