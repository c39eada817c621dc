"""Errors that reach the user as one line and a documented exit code (see `cli.py`)."""

from __future__ import annotations

import json
from collections.abc import Collection

from pydantic import ValidationError

# The exit codes (the table is in cli.py's docstring, ``canaryd --help`` and the README).
EXIT_OK, EXIT_DRIFT, EXIT_USAGE, EXIT_UNAVAILABLE, EXIT_INTERNAL = 0, 1, 2, 3, 4


class InputError(Exception):
    """Bad config, canary file or argument: exit code 2. The message names the file and the field."""


class BudgetSpent(Exception):
    """A backend's daily budget would be passed, so it is not probed: exit code 3 (not judged today)."""


def describe_validation_error(err: ValidationError, tags: Collection[str] = ()) -> str:
    """Pydantic's first error as ``field.path: message`` on one line.

    ``tags`` are a tagged union's tags (backend kinds), which pydantic puts in the path although the user
    never wrote them; a tag that matches nothing is reported on the discriminator field itself.
    """
    first = err.errors()[0]
    parts = [p for p in first["loc"] if p not in tags]
    msg = " ".join(first["msg"].removeprefix("Value error, ").splitlines())
    if first["type"] in ("union_tag_invalid", "union_tag_not_found"):
        field = str(first["ctx"]["discriminator"]).strip("'")
        parts.append(field)
        got = first["ctx"].get("tag")
        msg = f"unknown {field} {got!r} (known: {', '.join(tags)})" if got else f"{field} is required"
    loc = ".".join(_loc_part(p) for p in parts).replace(".[", "[")
    extra = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"{loc or '(top level)'}: {msg}{extra}"


def _loc_part(part: str | int) -> str:
    """A path element as the user would write it: an index in brackets, an odd key (a dot, a control
    character, empty) quoted as a TOML basic string, so the message stays one unambiguous line."""
    if isinstance(part, int):
        return f"[{part}]"
    if part and part.isprintable() and "." not in part and '"' not in part:
        return part
    return json.dumps(part)
