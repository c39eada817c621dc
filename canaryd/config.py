"""The config file (``canaryd.toml``): backends, suites, storage and comparison tolerance.

Relative paths are resolved against the config file's directory, so a config and its canaries can move
together. API keys never live in this file: a backend names the environment variable (``api_key_env``) or
file (``api_key_file``, e.g. a systemd credential) that holds its key.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from canaryd.canaries import ID_PATTERN
from canaryd.errors import InputError, describe_validation_error

_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BackendConfig(_Strict):
    name: Annotated[str, Field(pattern=ID_PATTERN)]
    kind: Literal["vllm", "openai"]
    base_url: str
    model: str
    api_key_env: Annotated[str | None, Field(pattern=_ENV_NAME)] = None
    api_key_file: Path | None = None
    timeout_s: Annotated[float, Field(gt=0, le=3600)] = 60.0
    connect_timeout_s: Annotated[float, Field(gt=0, le=600)] = 5.0
    concurrency: Annotated[int, Field(ge=1, le=256)] = 4

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not re.match(r"^https?://[^\s/]+", v):
            raise ValueError("must be an http:// or https:// URL")
        return v.rstrip("/")

    @model_validator(mode="after")
    def _one_key_source(self) -> Self:
        if self.api_key_env and self.api_key_file:
            raise ValueError("give at most one of api_key_env, api_key_file")
        return self

    def api_key(self) -> str | None:
        """Read the key at the last moment; it is handed to the HTTP client and nowhere else."""
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise InputError(f"backend {self.name!r}: environment variable {self.api_key_env} is not set")
            return key
        if self.api_key_file:
            path = self.api_key_file
            if not path.is_absolute() and os.environ.get("CREDENTIALS_DIRECTORY"):
                path = Path(os.environ["CREDENTIALS_DIRECTORY"]) / path
            try:
                return path.read_text(encoding="utf-8").strip()
            except OSError as e:
                raise InputError(
                    f"backend {self.name!r}: cannot read api_key_file {path}: {e.strerror}"
                ) from None
        return None


class SuiteRef(_Strict):
    path: Path
    backends: tuple[str, ...] | None = None  # None: every backend


class StorageConfig(_Strict):
    url: str | None = None  # SQLAlchemy URL; default sqlite under state_dir


class CompareConfig(_Strict):
    # Largest |Δ logprob| still called identical. 0: any change counts (right for batch-invariant engines).
    logprob_tolerance: Annotated[float, Field(ge=0)] = 0.0


class Config(_Strict):
    path: Path
    state_dir: Path
    backends: tuple[BackendConfig, ...]
    suites: tuple[SuiteRef, ...]
    storage: StorageConfig = StorageConfig()
    compare: CompareConfig = CompareConfig()

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
        return self

    @property
    def storage_url(self) -> str:
        return self.storage.url or f"sqlite:///{self.state_dir / 'canaryd.db'}"

    def backend(self, name: str) -> BackendConfig:
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
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{path}: config file not found (create one with `canaryd init`)") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read config: {e.strerror or e}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: invalid TOML: {e}") from None
    base = path.resolve().parent
    raw.setdefault("state_dir", str(default_state_dir()))
    raw.setdefault("backends", [])
    raw.setdefault("suites", [])
    try:
        cfg = Config.model_validate({**raw, "path": path})
    except ValidationError as e:
        raise InputError(f"{path}: {describe_validation_error(e)}") from None
    if not cfg.backends:
        raise InputError(f"{path}: backends: at least one [[backends]] entry is required")
    if not cfg.suites:
        raise InputError(f"{path}: suites: at least one canary file is required")
    return cfg.model_copy(
        update={
            "state_dir": _resolve(base, cfg.state_dir),
            "suites": tuple(s.model_copy(update={"path": _resolve(base, s.path)}) for s in cfg.suites),
        }
    )


def _resolve(base: Path, p: Path) -> Path:
    p = p.expanduser()
    return p if p.is_absolute() else base / p
