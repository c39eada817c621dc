"""The serving configurations that answered a run, per backend: what ``check``, ``diff``, the record and
the gates (``--max-configurations``, pins) say about them.

A configuration is `canaryd.stack.configuration_of` an answer's stack: its identity fields (the
fingerprint, the provider or deployment). An answer that names none is "" here; a backend whose answers all
name none has *unknown* configurations (Ollama's constant fingerprint, most gateways): canaryd says so and
keeps one baseline per canary × backend, and the configuration gate cannot be checked there.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from canaryd.stack import configuration_of

UNKNOWN = "unknown (no fingerprint): one baseline per canary"


@dataclass(frozen=True, slots=True)
class Served:
    """The configurations that answered one backend: sorted ids ("" an answer naming none) and those
    new to some canary in this run (its ``new-configuration`` verdicts)."""

    backend: str
    ids: tuple[str, ...]
    new: tuple[str, ...] = ()

    @property
    def known(self) -> bool:
        """Whether any answer named its configuration."""
        return any(self.ids)

    @property
    def count(self) -> int | None:
        """How many configurations answered (None: unknown, no answer named one)."""
        return len(self.ids) if self.known else None

    def names(self) -> str:
        return ", ".join(i or "(none)" for i in self.ids)

    def describe(self) -> str:
        """One line: ``b: 2 serving configurations (abc, def), new: def``."""
        if not self.known:
            return f"{self.backend}: serving configurations {UNKNOWN}"
        n = len(self.ids)
        line = f"{self.backend}: {n} serving configuration{'s' if n != 1 else ''} ({self.names()})"
        return line + (f", new: {', '.join(self.new)}" if self.new else "")

    def as_dict(self) -> dict:
        doc: dict = {"count": self.count, "ids": [i for i in self.ids if i], "new": list(self.new)}
        if not self.known:
            doc["note"] = UNKNOWN
        elif "" in self.ids:
            doc["unnamed"] = True  # some answers named no configuration: "" counts as one
        return doc


def served(results: Iterable) -> dict[str, Served]:
    """Each backend's `Served` in a run's results (`canaryd.probe.run.Result`: answers that got through)."""
    ids: dict[str, set[str]] = {}
    new: dict[str, set[str]] = {}
    for r in results:
        obs = r.observation
        if not obs.ok:
            ids.setdefault(obs.backend, set())
            continue
        configuration = configuration_of(obs.stack)
        ids.setdefault(obs.backend, set()).add(configuration)
        if r.comparison.verdict.value == "new-configuration":
            new.setdefault(obs.backend, set()).add(configuration)
    return {b: Served(b, tuple(sorted(k)), tuple(sorted(new.get(b, ())))) for b, k in ids.items() if k}


def over_limit(seen: Sequence[Served], limit: int | None) -> list[str]:
    """One line per backend served by more than ``limit`` configurations (None: no limit)."""
    if limit is None:
        return []
    return [
        f"backend {s.backend!r}: served by {s.count} configurations ({s.names()}), more than "
        f"--max-configurations {limit}"
        for s in seen
        if s.count is not None and s.count > limit
    ]


def unchecked(seen: Sequence[Served], limit: int | None) -> list[str]:
    """Backends whose configurations cannot be counted although a limit was asked for."""
    if limit is None:
        return []
    return [
        f"backend {s.backend!r}: --max-configurations not checked: {UNKNOWN}" for s in seen if not s.known
    ]
