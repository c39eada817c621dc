"""The config file (``canaryd.toml``): backends, suites, storage and comparison tolerance.

Relative paths are resolved against the config file's directory, so a config and its canaries can move
together. API keys never live in this file: a backend names the environment variable (``api_key_env``) or
file (``api_key_file``, e.g. a systemd credential) that holds its key.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path
from typing import Annotated, Self, Union

import tomli
from pydantic import Field, ValidationError, field_validator, model_validator

from canaryd.backends import KINDS, BackendSettings, settings_of
from canaryd.canaries import ID_PATTERN
from canaryd.errors import InputError, describe_validation_error
from canaryd.fields import Duration, Strict, parse_duration
from canaryd.files import read_regular

__all__ = ["Config", "find_config", "load_config", "parse_duration"]


CONFIG_BYTES = 16 << 20  # a config file larger than this is refused unread


class SuiteRef(Strict):
    path: Path
    backends: tuple[str, ...] | None = None  # None: every backend


class StorageConfig(Strict):
    url: str | None = None  # SQLAlchemy URL; default sqlite under state_dir


class CompareConfig(Strict):
    # Largest |Δ logprob| still called identical. 0: any change counts (right for batch-invariant engines).
    logprob_tolerance: Annotated[float, Field(ge=0)] = 0.0
    # False-alarm rate per sampled-canary comparison (split over its two tests: see sampled.py).
    alpha: Annotated[float, Field(ge=1e-6, lt=1)] = 0.001  # below 1e-6 its permutation test would not fit
    # Calibrated canaries (``baseline calibrate``, see stats.py). Outside the exact regime one canary beyond
    # its noise is a drift verdict only when the backend's alarm is on: ``min_out`` canaries beyond noise in
    # one cycle, or the e-CUSUM reaching ``arl`` (≈ the mean number of cycles between false alarms).
    # ``min_out`` unset: the fewest that happen by chance at most once in ``arl`` cycles (stats.min_out_for).
    min_out: Annotated[int, Field(ge=1)] | None = None
    arl: Annotated[float, Field(gt=1)] = 10_000.0
    # Probes per canary for `baseline calibrate` (split over the load levels) and the filler batch sizes.
    calibration_k: Annotated[int, Field(ge=2, le=1000)] = 20
    calibration_batch_sizes: Annotated[
        tuple[Annotated[int, Field(ge=1, le=256)], ...], Field(min_length=1)
    ] = (1, 8)
    # Learning by default (docs/detection.md, "Learning by default"): a canary without a noise model is
    # not judged at tolerance 0 unless first contact showed the backend exact. ``learn_first`` probes at
    # first contact (half alone, half crowded) decide the regime; a noisy canary is then *learning* and
    # gathers ``learn_per_pass`` probes a pass (alone and crowded), beside its own answer, until ``learn_k``
    # are in; after ``learn_max_passes`` passes it is fit from what it has (at least 3 probes), or stays
    # learning.
    learn: bool = True
    learn_k: Annotated[int, Field(ge=3, le=1000)] = 24
    learn_first: Annotated[int, Field(ge=2, le=100)] = 4
    learn_per_pass: Annotated[int, Field(ge=0, le=100)] = 2
    learn_max_passes: Annotated[int, Field(ge=2, le=100_000)] = 30
    # Calibration that lives (docs/detection.md): a canary out of its noise whose logprobs kept their
    # location gets ``refit_probes`` more probes, added to its model when they keep it too; no refit widens
    # the threshold beyond ``refit_cap`` times the first model's.
    refit: bool = True
    refit_probes: Annotated[int, Field(ge=1, le=100)] = 3
    refit_cap: Annotated[float, Field(ge=1, le=100)] = 3.0


class ScheduleConfig(Strict):
    """When the daemon probes what: every backend × suite by default, every 5 minutes."""

    name: Annotated[str, Field(pattern=ID_PATTERN)] = "default"
    every: Duration | None = None
    cron: str | None = None  # crontab syntax, UTC
    jitter: Duration = 0.0
    backends: tuple[str, ...] | None = None  # None: all
    suites: tuple[str, ...] | None = None  # suite names (the [suite] name); None: all

    @model_validator(mode="after")
    def _one_trigger(self) -> Self:
        if self.every is not None and self.cron is not None:
            raise ValueError("give at most one of every, cron")
        if self.every is not None and self.every < 1:
            raise ValueError("every must be at least 1s")
        if self.cron is not None:
            from apscheduler.triggers.cron import CronTrigger

            try:
                CronTrigger.from_crontab(self.cron)
            except ValueError as e:
                raise ValueError(f"invalid cron expression {self.cron!r}: {e}") from None
        return self

    @property
    def every_s(self) -> float | None:
        """Seconds between passes for an interval schedule (5 minutes when neither is given)."""
        return self.every if self.every is not None else (None if self.cron else 300.0)

    @property
    def interval_s(self) -> float:
        """The nominal gap between passes (for cron: the smallest gap in the next few weeks' firings)."""
        return self.every_s if self.every_s is not None else min(self._cron_gaps())

    @property
    def longest_gap_s(self) -> float:
        """The longest gap between passes (for cron, e.g. a night or a weekend): what a lease must outlast."""
        return self.every_s if self.every_s is not None else max(self._cron_gaps())

    def _cron_gaps(self, firings: int = 30) -> list[float]:
        from datetime import UTC, datetime

        from apscheduler.triggers.cron import CronTrigger

        trigger, t, gaps = CronTrigger.from_crontab(self.cron, timezone=UTC), datetime.now(UTC), []
        prev = trigger.get_next_fire_time(None, t)
        for _ in range(firings):
            nxt = trigger.get_next_fire_time(prev, prev)
            gaps.append((nxt - prev).total_seconds())
            prev = nxt
        return gaps


class DaemonConfig(Strict):
    listen: str = "127.0.0.1:9464"  # metrics; loopback unless you mean it
    # Recorded with every run, so daemons sharing one database can be told apart (default: hostname).
    instance: Annotated[str | None, Field(pattern=ID_PATTERN)] = None
    fingerprint_window: Duration = 3600.0  # distinct fingerprints are counted over this window
    # TLS and basic auth for the listener: a Prometheus exporter-toolkit web config file (docs/daemon.md).
    web_config: Path | None = None
    # Requests in flight at once across all backends (each backend's own `concurrency` holds as well), and
    # backends probed at once: what one daemon carries (docs/fleets.md).
    max_in_flight: Annotated[int, Field(ge=1, le=4096)] = 64

    @field_validator("listen")
    @classmethod
    def _host_port(cls, v: str) -> str:
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("must be host:port, e.g. 127.0.0.1:9464")
        return v

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]"), int(port)


class LimitsConfig(Strict):
    """Caps on what canaryd accepts from files and exports to Prometheus (the safe defaults suit canaries)."""

    # A Prometheus label value longer than this is cut and marked (the full value stays in the database).
    label_length: Annotated[int, Field(ge=16, le=4096)] = 128
    # A canary suite file larger than this is refused before it is read.
    suite_bytes: Annotated[int, Field(ge=1024, le=1 << 30)] = 16 << 20


class Config(Strict):
    path: Path
    state_dir: Path
    backends: tuple[BackendSettings, ...]  # each entry its kind's own block: see `_validating`
    suites: tuple[SuiteRef, ...]
    storage: StorageConfig = StorageConfig()
    compare: CompareConfig = CompareConfig()
    daemon: DaemonConfig = DaemonConfig()
    limits: LimitsConfig = LimitsConfig()
    schedules: tuple[ScheduleConfig, ...] = (ScheduleConfig(),)

    @field_validator("suites", mode="before")
    @classmethod
    def _suite_shorthand(cls, v: object) -> object:
        return [{"path": s} if isinstance(s, str) else s for s in v] if isinstance(v, list) else v

    @model_validator(mode="after")
    def _references(self) -> Self:
        names = [b.name for b in self.backends]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate backend name {dupes[0]!r}")
        for i, s in enumerate(self.suites):
            for b in s.backends or ():
                if b not in names:
                    raise ValueError(
                        f"suites[{i}].backends: unknown backend {b!r} (known: {', '.join(names)})"
                    )
        self._check_reference_backends()
        return self

    def _check_reference_backends(self) -> None:
        """A backend's ``reference`` names another backend whose kind can score; references form no cycle
        (a reference is checked by its own reference only when it is probed itself)."""
        by_name = {b.name: b for b in self.backends}
        for b in self.backends:
            ref = b.reference
            if ref is None:
                continue
            where = f"backends.{b.name}.reference"
            if ref not in by_name:
                raise ValueError(f"{where}: unknown backend {ref!r} (known: {', '.join(by_name)})")
            if ref == b.name:
                raise ValueError(f"{where}: a backend cannot be its own reference")
            if not by_name[ref].scores:
                raise ValueError(
                    f"{where}: backend {ref!r} (kind {by_name[ref].kind}) cannot score a given continuation "
                    "(a reference must: e.g. kind vllm)"
                )
            seen, cur = [b.name], ref
            while cur is not None:
                if cur in seen:
                    raise ValueError(f"{where}: references form a cycle ({' -> '.join([*seen, cur])})")
                seen.append(cur)
                cur = by_name[cur].reference if cur in by_name else None

    @property
    def storage_url(self) -> str:
        return self.storage.url or f"sqlite:///{self.state_dir / 'canaryd.db'}"

    def backend(self, name: str) -> BackendSettings:
        for b in self.backends:
            if b.name == name:
                return b
        raise InputError(
            f"{self.path}: unknown backend {name!r} (known: {', '.join(b.name for b in self.backends)})"
        )


def default_state_dir() -> Path:
    if os.environ.get("STATE_DIRECTORY"):  # set by systemd's StateDirectory=
        return Path(os.environ["STATE_DIRECTORY"].split(":")[0])
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "canaryd"


def find_config(explicit: Path | None) -> Path:
    """--config, then $CANARYD_CONFIG, ./canaryd.toml, $CONFIGURATION_DIRECTORY, /etc/canaryd."""
    if explicit is not None:
        return explicit
    if os.environ.get("CANARYD_CONFIG"):
        return Path(os.environ["CANARYD_CONFIG"])
    candidates = [Path("canaryd.toml")]
    if os.environ.get("CONFIGURATION_DIRECTORY"):
        candidates.append(Path(os.environ["CONFIGURATION_DIRECTORY"]) / "canaryd.toml")
    candidates.append(Path("/etc/canaryd/canaryd.toml"))
    return next((c for c in candidates if c.exists()), candidates[0])


def load_config(path: Path) -> Config:
    """Parse and validate a config file; errors raise `InputError` naming the file and the field."""
    try:
        raw = tomli.loads(read_regular(path, "config file", limit=CONFIG_BYTES))
    except FileNotFoundError:
        raise InputError(f"{path}: config file not found (create one with `canaryd init`)") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read config: {e.strerror or e}") from None
    except (tomli.TOMLDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: invalid TOML: {e}") from None
    base = path.resolve().parent
    raw.setdefault("state_dir", str(default_state_dir()))
    raw.setdefault("backends", [])
    raw.setdefault("suites", [])
    try:
        cfg = _validating(_kinds(raw["backends"])).model_validate({**raw, "path": path})
    except ValidationError as e:
        first = e.errors()[0]
        loc = [p for p in first["loc"] if p not in KINDS]  # a kind's tag is not a field the user wrote
        hint = ""
        if first["type"] == "extra_forbidden" and len(loc) == 3 and loc[2] in Config.model_fields:
            hint = f" (TOML: a key after a [[{loc[0]}]] table belongs to it; move it above)"
        raise InputError(f"{path}: {describe_validation_error(e, tags=KINDS)}{hint}") from None
    if not cfg.backends:
        raise InputError(f"{path}: backends: at least one [[backends]] entry is required")
    if not cfg.suites:
        raise InputError(f"{path}: suites: at least one canary file is required")
    web = cfg.daemon.web_config
    return cfg.model_copy(
        update={
            "state_dir": _resolve(base, cfg.state_dir),
            "suites": tuple(s.model_copy(update={"path": _resolve(base, s.path)}) for s in cfg.suites),
            "daemon": cfg.daemon.model_copy(update={"web_config": web and _resolve(base, web)}),
        }
    )


def _kinds(entries: object) -> frozenset[str]:
    """The registered kinds a config's ``[[backends]]`` name; every kind when one is missing or unknown, so
    that the error lists what is known."""
    kinds = (
        [e.get("kind") if isinstance(e, dict) else None for e in entries] if isinstance(entries, list) else []
    )
    if kinds and all(isinstance(k, str) and k in KINDS for k in kinds):
        return frozenset(kinds)
    return frozenset(KINDS)


@cache
def _validating(kinds: frozenset[str]) -> type[Config]:
    """`Config` whose ``backends`` validate against the named kinds' own blocks, chosen by ``kind``.

    Only the kinds a file uses are imported and built: each kind's pydantic model costs start-up time
    (`validate` and every command load the config), and the registry keeps growing."""
    types = tuple(settings_of(k) for k in KINDS if k in kinds)  # registry order: stable error messages
    entry = Annotated[Union[types], Field(discriminator="kind")] if len(types) > 1 else types[0]  # noqa: UP007
    return type("Config", (Config,), {"__annotations__": {"backends": tuple[entry, ...]}})  # type: ignore[valid-type]


def _resolve(base: Path, p: Path) -> Path:
    p = p.expanduser()
    return p if p.is_absolute() else base / p
