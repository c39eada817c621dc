"""``canaryd ops``: the operations files shipped with this version (rules, dashboard, unit, runbook)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from canaryd.commands import JsonFlag, WholeHelpGroup, emit
from canaryd.errors import EXIT_OK

app = typer.Typer(
    name="ops",
    help="Operations files shipped in the package.",
    no_args_is_help=True,
    rich_markup_mode=None,
    cls=WholeHelpGroup,
)


@app.command("export")
def export(
    dest: Annotated[Path, typer.Argument(help="Directory to write them under (created if missing).")],
    force: Annotated[bool, typer.Option("--force", help="Overwrite existing files.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Write the alert rules and their tests, the Grafana dashboard, the systemd unit and the runbook."""
    from canaryd.scaffold import export_files

    written = export_files(dest, force=force)
    if as_json:
        emit({"exit_code": EXIT_OK, "written": [str(p) for p in written]})
        return
    for path in written:
        print(f"wrote {path}")
