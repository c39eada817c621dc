"""``canaryd db``: the history database's schema revision, and migrating it."""

from __future__ import annotations

from typing import Annotated

import typer

from canaryd.commands import JsonFlag, WholeHelpGroup, load
from canaryd.errors import EXIT_DRIFT, EXIT_OK

app = typer.Typer(
    name="db",
    help="The history database's schema (Alembic migrations).",
    no_args_is_help=True,
    rich_markup_mode=None,
    cls=WholeHelpGroup,
)


@app.command("upgrade")
def upgrade(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """Migrate the database to this canaryd's schema (every command and the daemon also do it at start)."""
    from canaryd.report.console import show_migration
    from canaryd.store import upgrade_database

    show_migration(*upgrade_database(load(ctx)), as_json=as_json)


@app.command("current")
def current(
    ctx: typer.Context,
    check: Annotated[bool, typer.Option("--check", help="Exit 1 unless the database is at head.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Print the database's schema revision (changes nothing; a missing database is an error, exit 2)."""
    from canaryd.report.console import show_revision
    from canaryd.store import existing_revision
    from canaryd.store.engine import SCHEMA_REVISION, known_revisions

    rev = existing_revision(load(ctx))
    code = EXIT_DRIFT if check and rev != SCHEMA_REVISION else EXIT_OK
    show_revision(rev, SCHEMA_REVISION, known_revisions(), code if as_json else None)
    raise typer.Exit(code)
