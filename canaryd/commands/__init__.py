"""The commands of the CLI, one module per topic, each command one function on its module's `commands`
app (`canaryd.cli` lists them all), and what they share: the config, the store, the console, JSON.

Deliberately light (the standard library and typer): ``canaryd --help``, ``--version`` and ``validate``
must start in a fraction of a second, so a command imports the rest of canaryd (pydantic models, the
store's SQLAlchemy, rich, the HTTP client) inside its own body.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer.core import TyperGroup

if TYPE_CHECKING:
    from pathlib import Path

    from rich.console import Console

    from canaryd.config import Config
    from canaryd.store import Store

JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]


class WholeHelpGroup(TyperGroup):
    """A command group whose list of commands wraps each one's summary instead of cutting it with "..."."""

    def format_commands(self, ctx, formatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                rows.append((name, cmd.get_short_help_str(limit=10_000)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def commands() -> typer.Typer:
    """The app of one commands module: its commands join ``canaryd``'s own list (`canaryd.cli`), in the
    order they are defined, so that a new command is one function here and nothing else."""
    return typer.Typer(rich_markup_mode=None)


class State:
    config_path: Path | None = None
    log_level: str | None = None
    help_asked = False  # `--help` anywhere: nothing runs, so nothing logs


def load(ctx: typer.Context) -> Config:
    from canaryd.config import find_config, load_config

    return load_config(find_config(ctx.obj.config_path))


@contextmanager
def store_of(cfg: Config) -> Iterator[Store]:
    """The history store, created and migrated if need be (commands that probe or write)."""
    from canaryd.store import open_store

    store = open_store(cfg)
    try:
        yield store
    finally:
        store.close()


@contextmanager
def reader_of(cfg: Config) -> Iterator[Store]:
    """The history store for a command that only reads: never created, never migrated. A missing
    database is a config problem (exit 2); one at another schema revision a storage error (exit 4)."""
    from canaryd.store import existing_revision
    from canaryd.store.engine import SCHEMA_REVISION, SchemaMismatch, known_revisions

    rev = existing_revision(cfg)
    if rev != SCHEMA_REVISION:
        if rev is None:
            why = "holds no canaryd schema"
        elif rev in known_revisions():
            why = f"is at schema revision {rev}, older than this canaryd's {SCHEMA_REVISION}"
        else:
            why = f"is at schema revision {rev}, newer than this canaryd's {SCHEMA_REVISION}: upgrade canaryd"
        fix = "" if rev not in (None, *known_revisions()) else ": run `canaryd db upgrade`"
        raise SchemaMismatch(f"{cfg.path}: the history database {why}{fix}")
    with store_of(cfg) as store:  # at head, so opening it migrates nothing
        yield store


def console(stderr: bool = False) -> Console:
    """A rich console for tables: the terminal's width on a terminal; piped, plain (see `print_tables`)
    and as wide as ``COLUMNS`` says, else 160 columns, so that lines stay whole for grep and diff."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else int(os.environ.get("COLUMNS", "") or 160)
    return Console(stderr=stderr, soft_wrap=False, width=width)


def emit(doc: dict[str, Any]) -> None:
    """A ``--json`` envelope on stdout: one object whose ``exit_code`` is the command's exit code."""
    print(json.dumps(doc, indent=2, ensure_ascii=False))


def show_progress(as_json: bool) -> bool:
    """Progress on stderr only on a terminal and never beside ``--json``."""
    return not as_json and sys.stderr.isatty()
