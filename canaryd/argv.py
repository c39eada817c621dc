"""The top-level command line as canaryd reads it before typer does: the global options and the command.

Deliberately light (the standard library only): ``python -m canaryd run`` asks `command_of` before any
heavy import, to catch its signals first (`canaryd.daemon.signals`), and every command hoists the global
options (`hoist_global_options`) before typer parses them.
"""

from __future__ import annotations

from collections.abc import Sequence

# The global options that take a value, accepted before or after the command (`hoist_global_options`).
GLOBAL_VALUED = frozenset({"-c", "--config", "--log-level"})


def _valued(arg: str) -> int:
    """How many arguments a global option with a value spans here (0: ``arg`` is not one)."""
    if arg.split("=", 1)[0] not in GLOBAL_VALUED:
        return 0
    return 1 if "=" in arg else 2


def command_of(argv: Sequence[str]) -> str | None:
    """The command a command line (without the program name) runs: its first word that is neither an
    option nor a global option's value (so that ``-c run.toml validate`` is ``validate``)."""
    i = 0
    while i < len(argv):
        if n := _valued(argv[i]):
            i += n
            continue
        if not argv[i].startswith("-"):
            return argv[i]
        i += 1
    return None


def hoist_global_options(argv: Sequence[str], runs_a_command: Sequence[str] = ()) -> list[str]:
    """``argv`` with the global options moved before the command, wherever they were, so that
    ``canaryd validate -c FILE`` means ``canaryd -c FILE validate``. Nothing after ``--`` moves; after a
    command that runs a command of its own (``preflight``), only what comes before its ``--``."""
    args = list(argv)
    front: list[str] = []
    rest: list[str] = []
    command: str | None = None
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--" or (command in runs_a_command and "--" not in args[i:]):
            rest.extend(args[i:])
            break
        if n := _valued(a):
            front.extend(args[i : i + n])
            i += n
            continue
        if command is None and not a.startswith("-"):
            command = a
        rest.append(a)
        i += 1
    return front + rest
