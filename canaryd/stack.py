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
from fnmatch import fnmatch


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


# What canaryd itself records in a stack has a version, stamped on every snapshot (`stamped`): bump
# RECORDER whenever a kind, the host facts or the secret rule (`hostfacts.is_secret_name`) starts or stops
# recording a field, or renames one, and say in CHANGED_BY which field names the new version may add or
# drop. tests/unit/test_recorder.py keeps each version's digest of the fields recorded from the recorded
# bodies, and fails until the bump. Stacks stored before the stamp are "1".
RECORDER_FIELD = "canaryd.recorder"
RECORDER = "4"

_CREDENTIAL_NAMES = ("*key*", "*token*", "*secret*", "*passw*", "*passphrase*", "*credential*")
# Per version, the field names (fnmatch patterns, matched in lower case) it may record where the version
# before did not, or no longer record: the only fields whose presence alone a recorder change explains.
CHANGED_BY: dict[str, tuple[str, ...]] = {
    "2": (RECORDER_FIELD, *_CREDENTIAL_NAMES),  # one secret-name rule instead of three
    "3": ("request.scoring_cache_salt",),  # scoring requests carry a cache_salt
    "4": _CREDENTIAL_NAMES,  # the secret rule fails closed on a credential name with a qualifier
}


def stamped(fields: dict[str, str]) -> dict[str, str]:
    """A kind's snapshot with the version of canaryd's recording rules it was taken under."""
    return {**fields, RECORDER_FIELD: RECORDER}


def split(before: dict[str, str], after: dict[str, str]) -> tuple[list[FieldChange], list[FieldChange]]:
    """`diff`, split into (what the serving side changed, what canaryd records differently).

    Between stacks recorded under different versions of canaryd's rules (an upgrade, or fleet members of
    two versions), a field present on one side only is a recording change when a version in between says
    it may add or drop that name (`CHANGED_BY`), and so is a JSON value only spelled anew (``"\\u00e9"``
    and ``"é"``; ``"0"`` and ``"false"`` are two values). Anything else is the server's: a field a baseline
    of any age never had, or a value that moved, is a stack change whatever the versions."""
    changes = diff(before, after)
    old, new = before.get(RECORDER_FIELD, "1"), after.get(RECORDER_FIELD, "1")
    if old == new:
        return changes, []
    names = _changed_between(old, new)
    recorded = [
        c
        for c in changes
        if c.field == RECORDER_FIELD
        or _respelled(c.before, c.after)
        or ((c.before is None or c.after is None) and any(fnmatch(c.field.lower(), n) for n in names))
    ]
    return [c for c in changes if c not in recorded], recorded


def _changed_between(a: str, b: str) -> tuple[str, ...]:
    """The names the versions after the older of two and up to the newer may add or drop."""
    lo, hi = sorted((_version(a), _version(b)))
    return tuple(n for v, names in CHANGED_BY.items() if lo < int(v) <= hi for n in names)


def _version(value: str) -> int:
    return int(value) if value.isdigit() else 1


def _respelled(before: str | None, after: str | None) -> bool:
    """Two spellings of one JSON value, of one type (a number is not a boolean, nor an int a float)."""
    if before is None or after is None:
        return False
    try:
        a, b = json.loads(before), json.loads(after)
    except ValueError:
        return False
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


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


# The per-response stack fields that name the server configuration which answered, an explicit allow-list:
# the engine's own fingerprint (vLLM: version and a hash of its whole config, so the dtype moves it),
# which upstream provider a router picked (OpenRouter's body field and header), which deployment of a
# cloud endpoint (Azure's session and region headers) or of a LiteLLM proxy (its model id and API base)
# answered. Snapshot fields (taken once per pass) never name the configuration of one response, and
# per-request values (ids, timings, rate limits) would make every response its own configuration.
IDENTITY_FIELDS = (
    "response.system_fingerprint",
    "response.provider",
    "header.x-openrouter-provider",
    "header.azureml-model-session",
    "header.x-ms-region",
    "gateway.model_id",
    "gateway.api_base",
)
_ABSENT = ("", "None", "null")  # how a missing fingerprint reaches a flat string map


def identity_of(fields: dict[str, str], names: Iterable[str] = IDENTITY_FIELDS) -> dict[str, str]:
    """The identity fields present in a stack (a value that stands for "absent" is absent)."""
    return {k: fields[k] for k in names if fields.get(k, "") not in _ABSENT}


def configuration_of(fields: dict[str, str], names: Iterable[str] = IDENTITY_FIELDS) -> str:
    """The serving configuration that answered: 12 hex digits of a hash over the stack's identity fields,
    or "" when the response names none (no fingerprint, or a constant one a kind already dropped): then
    canaryd cannot tell configurations apart and keeps one baseline per canary × backend.

    ``names`` is for the schema migration, which keeps the allow-list of its day."""
    identity = identity_of(fields, names)
    return hashlib.sha256(canonical(identity)).hexdigest()[:12] if identity else ""


def configurations_of(stacks: Iterable[dict[str, str]]) -> list[str]:
    """The distinct configurations of these stacks, sorted ("" included when one named none)."""
    return sorted({configuration_of(s) for s in stacks})
