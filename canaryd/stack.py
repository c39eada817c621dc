"""Stack snapshots: the serving side of a probe, as a flat, canonical, hashable map.

A snapshot is a ``dict[str, str]`` of dotted field names (``vllm.version``, ``metrics.vllm:cache_config_info.
cache_dtype``, ``response.system_fingerprint`` …). Flat string maps diff cleanly, hash stably and show up
readably in a table, which is what on-call needs when the question is "what moved?".
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any


def flatten(prefix: str, value: Any) -> dict[str, str]:
    """Flatten nested JSON-like data into dotted keys with string values (lists are indexed)."""
    out: dict[str, str] = {}
    if isinstance(value, dict):
        for k, v in value.items():
            out.update(flatten(f"{prefix}.{k}" if prefix else str(k), v))
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            out.update(flatten(f"{prefix}[{i}]", v))
    else:
        out[prefix] = "" if value is None else str(value)
    return out


def canonical(fields: dict[str, str]) -> bytes:
    """The one serialisation the hash is taken over: sorted keys, no whitespace, UTF-8."""
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def stack_hash(fields: dict[str, str]) -> str:
    return hashlib.sha256(canonical(fields)).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class FieldChange:
    field: str
    before: str | None  # None: the field was absent
    after: str | None


def diff(before: dict[str, str], after: dict[str, str]) -> list[FieldChange]:
    """Fields that were added, removed or changed, sorted by name."""
    keys = sorted(before.keys() | after.keys())
    return [FieldChange(k, before.get(k), after.get(k)) for k in keys if before.get(k) != after.get(k)]
