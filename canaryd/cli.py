"""The ``canaryd`` command line.

Exit codes (also in ``canaryd --help`` and the README):

0  every canary identical to its baseline, within its noise or learning it (or a new baseline was recorded)
1  drift: a regression, answer drift, logprob drift or stack change
2  bad config, canary file or usage (also a metrics address in use, an unusable state_dir or storage.url),
   or a backend refused a request as configured (an unsupported parameter or value, an engine's cap on
   top-k logprobs: one line names the backend, the parameter and the request-profile key that fixes it)
3  a backend was unreachable or failing, or its daily budget is spent, so it could not be judged
4  internal or storage error (a bug or a broken database: see the log)

``preflight`` exits 1 or 3 as ``check --pin`` would, without running its command; once the canaries pass,
it exits with the command's own exit code.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Annotated

import typer
from typer.main import get_command_name

from canaryd import __version__
from canaryd.argv import command_of, hoist_global_options
from canaryd.commands import (
    State,
    WholeHelpGroup,
    baseline,
    db,
    doctor,
    emit,
    fleet,
    history,
    ops,
    probe,
    record,
    report,
    service,
    setup,
)
from canaryd.errors import EXIT_INTERNAL, EXIT_UNAVAILABLE, EXIT_USAGE, BudgetSpent, InputError

# Commands whose work never logs: they set up logging (and import structlog) only if something does.
_QUIET = ("validate", "init")


def _version(value: bool) -> None:
    if value:
        print(f"canaryd {__version__} (python {sys.version.split()[0]})")
        raise typer.Exit()


def _main(
    ctx: typer.Context,
    config: Annotated[
        Path | None,
        typer.Option("--config", "-c", help="Config file (default: search); before or after the command."),
    ] = None,
    log_level: Annotated[
        str | None, typer.Option(help="debug, info, warning or error [default: warning; info for run].")
    ] = None,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    if log_level is not None and log_level.lower() not in ("debug", "info", "warning", "error"):
        raise InputError(f"--log-level: unknown level {log_level!r} (debug, info, warning, error)")
    from canaryd import lazy

    lazy.on_first_log(partial(_configure_logging, log_level or "warning"))
    if ctx.invoked_subcommand not in _QUIET and not State.help_asked:
        lazy.set_up_logging()  # now: the command's modules log through structlog directly
    ctx.obj = State()
    ctx.obj.config_path, ctx.obj.log_level = config, log_level


# Every command of a module, in the module's order; `canaryd --help` lists the commands in this order, and
# the groups (`canaryd baseline ...`) after them.
MODULES = (probe, record, service, fleet, history, setup, report, doctor, baseline, db, ops)


def _app(modules: Sequence[ModuleType]) -> typer.Typer:
    """The ``canaryd`` app of these modules' commands."""
    # Plain help (no rich markup): every bracket and default shows as written, and rich stays unimported.
    new = typer.Typer(
        help="Known-answer canaries for LLM serving stacks.\n\n"
        "Exit codes: 0 identical, 1 drift, 2 bad config/usage or a request refused as configured, "
        "3 backend unreachable or over budget, 4 internal error.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        rich_markup_mode=None,
        cls=WholeHelpGroup,
    )
    new.callback()(_main)
    for module in modules:
        new.add_typer(module.app)
    return new


app = _app(MODULES)


def _names(module: ModuleType) -> set[str]:
    """The top-level names a commands module adds: its group's, or each of its commands'."""
    if isinstance(module.app.info.name, str):
        return {module.app.info.name}
    return {get_command_name(c.name or c.callback.__name__) for c in module.app.registered_commands}


def _app_for(command: str | None) -> typer.Typer:
    """The app that parses a command line running ``command``: one of its module's commands alone. Typer
    builds every command's parameters before it runs one, and that was a tenth of ``validate``'s start-up;
    the whole app parses anything else (no command, an unknown one) and every ``--help``."""
    module = next((m for m in MODULES if command in _names(m)), None)
    return app if module is None else _app((module,))


def _configure_logging(level: str) -> None:
    from canaryd import log as logsetup

    logsetup.configure(level)


def main(argv: list[str] | None = None) -> None:
    from canaryd import lazy
    from canaryd.files import private_umask

    lazy.on_first_log(partial(_configure_logging, "warning"))  # until the options say otherwise

    private_umask()  # what canaryd creates (history, WAL, exports, pins, records) is its owner's alone
    args = hoist_global_options(sys.argv[1:] if argv is None else argv, runs_a_command=("preflight",))
    own = args[: args.index("--") if "--" in args else None]  # canaryd's own, not a benchmark's
    as_json, State.help_asked = "--json" in own, "--help" in own
    try:
        # usage errors exit 2 and typer.Exit(code) exits with code; help is the whole app's (`--help run`)
        (app if State.help_asked else _app_for(command_of(args)))(args, prog_name="canaryd")
    except InputError as e:
        _fail(EXIT_USAGE, "canaryd: error", str(e), as_json)
    except BudgetSpent as e:
        _fail(EXIT_UNAVAILABLE, "canaryd: over budget", str(e), as_json)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # the last line of defence: one line, no traceback unless debugging
        sqlalchemy = sys.modules.get("sqlalchemy.exc")  # imported by whatever raised it, if anything did
        if sqlalchemy is not None and isinstance(e, sqlalchemy.SQLAlchemyError):
            _fail(EXIT_INTERNAL, "canaryd: storage error", str(e).splitlines()[0], as_json)
        lazy.Logger("canaryd").debug("internal_error", exc_info=True)
        _fail(EXIT_INTERNAL, "canaryd: internal error", f"{e.__class__.__name__}: {e}", as_json)


def _fail(code: int, prefix: str, message: str, as_json: bool) -> None:
    """One line on stderr (at priority err under journald) and the exit code; under ``--json`` the
    envelope on stdout too."""
    from canaryd.log import to_stderr

    to_stderr(f"{prefix}: {message}", "error")
    if as_json:
        emit({"exit_code": code, "error": message})
    sys.exit(code)
