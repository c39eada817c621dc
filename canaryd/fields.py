"""Field types shared by the config file and every backend kind's own config block.

They sit below both, so a kind module can declare its typed config without importing the config file's
loader (which imports the kinds through the registry).
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from canaryd.errors import InputError

ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNIT_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value: object) -> float:
    """Prometheus-style durations ("30s", "5m", "1h30m") or plain seconds, to seconds."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str) and value and _DURATION.sub("", value) == "":
        return sum(float(n) * _UNIT_S[u] for n, u in _DURATION.findall(value))
    raise ValueError(f"not a duration: {value!r} (use e.g. 30s, 5m, 1h30m)")


def since_time(value: str) -> datetime:
    """``--since``: an ISO 8601 time (naive means UTC) or a duration back from now (2h, 30m, 7d)."""
    try:
        return datetime.now(UTC) - timedelta(seconds=parse_duration(value))
    except ValueError:
        pass
    try:
        t = datetime.fromisoformat(value)
    except ValueError:
        raise InputError(f"--since: {value!r} is neither an ISO 8601 time nor a duration (e.g. 2h)") from None
    return (t if t.tzinfo else t.replace(tzinfo=UTC)).astimezone(UTC)


Duration = Annotated[float, BeforeValidator(parse_duration), Field(ge=0)]


class Strict(BaseModel):
    """Config blocks reject unknown keys (a typo must not silently fall back to a default)."""

    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)
