"""Errors that reach the user as one line and a documented exit code (see `cli.py`)."""

from __future__ import annotations

from pydantic import ValidationError


class InputError(Exception):
    """Bad config, canary file or argument: exit code 2. The message names the file and the field."""


def describe_validation_error(err: ValidationError) -> str:
    """Pydantic's first error as ``field.path: message`` on one line."""
    first = err.errors()[0]
    loc = ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in first["loc"]).replace(".[", "[")
    msg = first["msg"].removeprefix("Value error, ")
    extra = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"{loc or '(top level)'}: {msg}{extra}"
