"""Stack snapshots: the serving side of a probe, as a flat, canonical, hashable map.

A snapshot is a ``dict[str, str]`` of dotted field names (``vllm.version``, ``metrics.vllm:cache_config_info.
cache_dtype``, ``response.system_fingerprint`` …). Flat string maps diff cleanly, hash stably and show up
readably in a table, which is what on-call needs when the question is "what moved?".
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass


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


def merge_stacks(stacks: Iterable[dict[str, str]]) -> dict[str, str]:
    """One stack for many observations of a backend: a field seen with several values keeps them all.

    Values are sorted and comma-joined, as a probe pass reports a fleet that answered from several
    configurations (several ``system_fingerprint``\\ s): such a stack never matches a single-valued pin.
    """
    seen: dict[str, set[str]] = {}
    for stack in stacks:
        for k, v in stack.items():
            seen.setdefault(k, set()).add(v)
    return {k: ",".join(sorted(v)) for k, v in sorted(seen.items())}
