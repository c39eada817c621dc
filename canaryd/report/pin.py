"""Pin files: each backend's serving stack written down, so a later session can prove it held still.

Line 2 of the reproducibility record: nothing in the stack changes between the two numbers you compare.
``canaryd pin`` probes (a pin describes the stack as it is *now*, and the probe's observations become
the pin's evidence, kept in the store) and writes JSON with sorted keys and one field per line, so
``git diff`` of two pins shows exactly which field moved. ``check --pin`` and ``preflight`` compare a
fresh probe with it: a pinned field that changed or disappeared has *moved* (fails); a field the pin
does not know is *new* (reported, never fails: a newer canaryd or engine may expose more facts). Against a
pin written under other recording rules (`canaryd.stack.split`), a field that canaryd added or dropped is
*recorded differently*, reported and never failing as well.

A pin also lists the serving configurations that answered (`canaryd.stack.configuration_of`): later, a
configuration the pin does not list fails the check, while a pinned one that happened not to answer does
not (a load balancer picks at random). With several pinned, the identity fields are checked through the
configurations, not field by field: a fleet's merged fingerprints differ from pass to pass with the
balancer's draws.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from canaryd.errors import InputError
from canaryd.files import read_regular
from canaryd.fleet import comparable
from canaryd.stack import IDENTITY_FIELDS, split, stack_hash

FORMAT = "canaryd-pin/1"
PIN_BYTES = 16 << 20  # a pin file larger than this is refused unread
# Fields that describe one request or one instant rather than the stack. Backends keep such values out
# of the stack already; this is the pin's own guard, since a pinned volatile field would always "move".
VOLATILE = ("header.date", "header.x-request-id", "header.openai-processing-ms", "header.x-ratelimit-")


def pinnable(fields: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in fields.items() if not k.startswith(VOLATILE)}


@dataclass(frozen=True, slots=True)
class PinnedBackend:
    kind: str
    fields: dict[str, str]
    run_id: int | None = None  # the probe run whose observations are the pin's evidence
    configurations: tuple[str, ...] | None = None  # None: a pin from before configurations were pinned


@dataclass(frozen=True, slots=True)
class Pin:
    created: str
    canaryd: str
    backends: dict[str, PinnedBackend]


def to_json(pin: Pin) -> str:
    doc = {
        "format": FORMAT,
        "canaryd": pin.canaryd,
        "created": pin.created,
        "backends": {
            name: {
                "kind": b.kind,
                "run_id": b.run_id,
                "stack_hash": stack_hash(b.fields),
                "fields": pinnable(b.fields),
                **({"configurations": list(b.configurations)} if b.configurations is not None else {}),
            }
            for name, b in pin.backends.items()
        },
    }
    return json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def load_pin(path: Path) -> Pin:
    """Read a pin file; anything unusable is an `InputError` naming the file and the field."""
    try:
        doc = json.loads(read_regular(path, "pin file", limit=PIN_BYTES))
    except FileNotFoundError:
        raise InputError(f"{path}: pin file not found (write one with `canaryd pin --out {path}`)") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read pin file: {e.strerror or e}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not a pin file: invalid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise InputError(f"{path}: format: expected {FORMAT!r}")
    backends = doc.get("backends")
    if not isinstance(backends, dict) or not backends:
        raise InputError(f"{path}: backends: at least one backend is required")
    out = {}
    for name, b in backends.items():
        fields = b.get("fields") if isinstance(b, dict) else None
        if not isinstance(fields, dict) or not all(isinstance(v, str) for v in fields.values()):
            raise InputError(f"{path}: backends.{name}.fields: must be a table of strings")
        configurations = b.get("configurations")
        if configurations is not None and (
            not isinstance(configurations, list) or not all(isinstance(c, str) for c in configurations)
        ):
            raise InputError(f"{path}: backends.{name}.configurations: must be a list of strings")
        pinned = tuple(configurations) if configurations is not None else None
        out[name] = PinnedBackend(str(b.get("kind", "")), fields, b.get("run_id"), pinned)
    return Pin(str(doc.get("created", "")), str(doc.get("canaryd", "")), out)


@dataclass(frozen=True, slots=True)
class PinField:
    backend: str
    field: str
    pinned: str | None  # None: new since the pin
    now: str | None  # None: gone since the pin
    recording: bool = False  # added or dropped by canaryd's recording rules since the pin, not the server

    @property
    def moved(self) -> bool:
        """Changed or gone. A new field, or one canaryd records differently, is reported but does not fail."""
        return self.pinned is not None and not self.recording

    def as_dict(self) -> dict:
        return {"backend": self.backend, "field": self.field, "pinned": self.pinned, "now": self.now}


@dataclass(frozen=True, slots=True)
class PinReport:
    path: str
    fields: tuple[PinField, ...]
    unreachable: tuple[str, ...] = ()  # pinned backends with no stack now: cannot be confirmed
    unpinned: tuple[tuple[str, str], ...] = ()  # (backend, configuration) that served but is not pinned

    @property
    def moved(self) -> list[PinField]:
        return [f for f in self.fields if f.moved]

    @property
    def recorded(self) -> list[PinField]:
        return [f for f in self.fields if f.recording]

    @property
    def matches(self) -> bool:
        return not self.moved and not self.unreachable and not self.unpinned

    def as_dict(self) -> dict:
        return {
            "file": self.path,
            "matches": self.matches,
            "moved": [f.as_dict() for f in self.moved],
            "new": [f.as_dict() for f in self.fields if not f.moved and not f.recording],
            **(
                {"recorded_differently": [f.as_dict() for f in recorded]}
                if (recorded := self.recorded)
                else {}
            ),
            "unreachable": list(self.unreachable),
            "unpinned_configurations": [{"backend": b, "configuration": c} for b, c in self.unpinned],
        }


def check_pin(
    pin: Pin,
    now: dict[str, dict[str, str]],
    path: str = "",
    configurations: dict[str, tuple[str, ...]] | None = None,
) -> PinReport:
    """Compare each pinned backend's stack now (``{}``: it was unreachable) with what the pin says, and the
    configurations that served now (``configurations``) with those it lists."""
    fields: list[PinField] = []
    unreachable = []
    unpinned: list[tuple[str, str]] = []
    for name in sorted(now.keys() & pin.backends.keys()):
        if not now[name]:
            unreachable.append(name)
            continue
        pinned = pin.backends[name]
        before, after, _ = comparable(pinnable(pinned.fields), pinnable(now[name]))  # `canaryd.fleet`
        if pinned.configurations is not None:
            if len(pinned.configurations) > 1:  # a fleet: its merged identity fields vary with the draws
                before, after = _without_identity(before), _without_identity(after)
            seen = (configurations or {}).get(name, ())
            unpinned += [(name, c) for c in seen if c not in pinned.configurations]
        changed, recorded = split(before, after)
        fields += [PinField(name, c.field, c.before, c.after) for c in changed]
        fields += [PinField(name, c.field, c.before, c.after, recording=True) for c in recorded]
    return PinReport(path, tuple(fields), tuple(unreachable), tuple(unpinned))


def _without_identity(fields: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in fields.items() if k not in IDENTITY_FIELDS}
