"""canaryd from Python: for notebooks, custom harnesses and the harness hooks.

The same behaviour as the CLI, which runs through these very calls: a check is `canaryd check`, a pin is
`canaryd pin`, a session is `canaryd preflight` around a block of Python instead of a command. Results are
objects with the CLI's exit code (``exit_code``); what the CLI would exit non-zero on is an exception:

* `InputError` (exit 2): bad config, canary file, pin, or a request a backend refused as configured;
* `StackMoved` (exit 1): a drift verdict, a moved pin field, too many serving configurations;
* `Unavailable` (exit 3): a backend down, or past its daily budget.

.. code-block:: python

    import canaryd.api as canaryd

    cd = canaryd.load("canaryd.toml")
    cd.check().raise_for_exit()              # the gate, as `canaryd check`
    cd.pin(out="stack.pin.json")             # as `canaryd pin --out stack.pin.json`
    with cd.session(pin="stack.pin.json", out_dir="runs/mmlu", harness="mine", task="mmlu") as s:
        for sample in samples:
            reply = client.chat.completions.create(...)
            s.sample(reply)                  # counts the configuration that answered, no extra request
    s.record                                 # the reproducibility record, also in runs/mmlu/
    cd.history(canary="add", limit=10)       # as `canaryd history --json`
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from canaryd.errors import EXIT_DRIFT, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE, BudgetSpent, InputError

if TYPE_CHECKING:
    from canaryd.config import Config
    from canaryd.probe.preflight import Evaluation, PassCheck
    from canaryd.report.pin import Pin

__all__ = ["Canaryd", "CanarydError", "Check", "InputError", "Session", "StackMoved", "Unavailable", "load"]


class CanarydError(Exception):
    """A check that the CLI would exit non-zero on; ``exit_code`` is that code, ``check`` the pass."""

    exit_code = EXIT_DRIFT

    def __init__(self, message: str, check: Check | None = None) -> None:
        super().__init__(message)
        self.check = check


class StackMoved(CanarydError):
    """Exit 1: a drift verdict, a pinned field that moved, or more serving configurations than allowed."""


class Unavailable(CanarydError):
    """Exit 3: a backend could not be reached or judged, or its daily budget would be passed."""

    exit_code = EXIT_UNAVAILABLE


@dataclass(frozen=True)
class Check:
    """One checked probe pass (`canaryd check --json`'s document is ``as_dict()``)."""

    passed: PassCheck

    @property
    def exit_code(self) -> int:
        return self.passed.exit_code

    @property
    def ok(self) -> bool:
        return self.exit_code == EXIT_OK

    @property
    def verdicts(self) -> dict[tuple[str, str], str]:
        """(backend, canary) → verdict (a chain's steps: the last one's)."""
        return {
            (r.observation.backend, r.observation.canary_id): r.comparison.verdict.value
            for r in self.passed.results
        }

    def as_dict(self) -> dict:
        return self.passed.as_dict()

    def raise_for_exit(self) -> Check:
        """This check, or the exception for its exit code (the CLI's exit semantics)."""
        code = self.exit_code
        if code == EXIT_OK:
            return self
        if code == EXIT_USAGE:
            raise InputError(
                "; ".join(self.passed.config_errors) or "a backend refused a request as configured"
            )
        if code == EXIT_UNAVAILABLE:
            first = self.passed.first_error
            why = f"{first.backend}: {first.error}" if first is not None else "a backend could not be judged"
            raise Unavailable(why, self)
        raise StackMoved(_moved(self.passed), self)


def _moved(passed: PassCheck) -> str:
    drift = [
        f"{r.observation.backend}/{r.observation.canary_id}: {r.comparison.verdict}" for r in passed.results
    ]
    drift = [d for d, r in zip(drift, passed.results, strict=True) if r.comparison.verdict.is_drift]
    parts = drift[:5] + ([f"… {len(drift) - 5} more"] if len(drift) > 5 else [])
    if passed.pin is not None and not passed.pin.matches:
        parts.append("the pin does not match")
    parts += passed.too_many
    return "the stack moved: " + "; ".join(parts)


class Canaryd:
    """One config: the backends and suites it names, and its history database."""

    def __init__(self, config: Config) -> None:
        self.config = config

    def check(
        self,
        backend: str | None = None,
        *,
        pin: str | Path | None = None,
        max_configurations: int | None = None,
    ) -> Check:
        """Probe, compare with the baselines (and the pin), as `canaryd check`; never raises on drift."""
        from canaryd.probe.preflight import checked_pass

        pinned, path = _pin(pin)
        return Check(checked_pass(self.config, backend, pinned, path, max_configurations))

    def pin(self, backend: str | None = None, *, out: str | Path | None = None) -> Pin:
        """Probe once and pin each backend's stack, as `canaryd pin` (written to ``out`` when given)."""
        from canaryd.files import write_private
        from canaryd.probe.preflight import take_pin
        from canaryd.report.pin import to_json

        taken = take_pin(self.config, backend)
        if taken.pin is None:
            failed = taken.failed
            why = f"{failed.backend}: {failed.error}" if failed is not None else "nothing was pinned"
            raise (InputError(why) if taken.exit_code == EXIT_USAGE else Unavailable(why))
        if out is not None:
            write_private(Path(out), to_json(taken.pin))
        return taken.pin

    def session(
        self,
        *,
        pin: str | Path | None = None,
        out_dir: str | Path = ".",
        backend: str | None = None,
        harness: str = "python",
        task: str = "",
        post_check: bool = True,
        max_configurations: int | None = None,
    ) -> Session:
        """A context manager: the gate at entry (`StackMoved`, `Unavailable`, `InputError` before the block
        runs), the record at exit (probed again with ``post_check``), as `canaryd preflight`."""
        return Session(self, pin, Path(out_dir), backend, harness, task, post_check, max_configurations)

    def history(self, backend: str | None = None, canary: str | None = None, limit: int = 50) -> list[dict]:
        """The newest observations, newest first, as `canaryd history --json` lists them."""
        from canaryd.commands import reader_of

        with reader_of(self.config) as store:
            rows = store.observations(backend=backend, canary_id=canary, limit=limit)
            return [r.as_dict() for r in rows]


def load(path: str | Path | None = None) -> Canaryd:
    """The config at ``path`` (None: searched as the CLI searches); `InputError` naming what is wrong."""
    from canaryd.config import find_config, load_config

    return Canaryd(load_config(find_config(None if path is None else Path(path))))


def _pin(pin: str | Path | None) -> tuple[Pin | None, Path | None]:
    if pin is None:
        return None, None
    from canaryd.report.pin import load_pin

    return load_pin(Path(pin)), Path(pin)


class Session:
    """An evaluation under canaryd: see `Canaryd.session`. ``sample()`` counts the serving configuration
    of each sample from what the provider returned with it; ``record`` is the record once it has ended."""

    def __init__(
        self,
        owner: Canaryd,
        pin: str | Path | None,
        out_dir: Path,
        backend: str | None,
        harness: str,
        task: str,
        post_check: bool,
        max_configurations: int | None,
    ) -> None:
        from canaryd.probe.preflight import Evaluation

        self._owner, self._pin_path, self.out_dir, self.backend = owner, pin, out_dir, backend
        self._post_check, self._max = post_check, max_configurations
        self.evaluation: Evaluation = Evaluation(harness, task)
        self.record_name = "canaryd-record"  # the record's files in out_dir: <record_name>.json and .md
        self.before: Check | None = None
        self.record: dict | None = None
        self._config: Config | None = None
        self._started: datetime | None = None

    def __enter__(self) -> Session:
        from canaryd.probe.preflight import begin

        pinned, path = _pin(self._pin_path)
        try:
            self._config, checked = begin(
                self._owner.config, pinned, path, backend=self.backend, max_configurations=self._max
            )
        except BudgetSpent as e:
            raise Unavailable(str(e)) from None
        self.before = Check(checked)
        self.before.raise_for_exit()
        self._started = datetime.now(UTC)
        return self

    def sample(self, response: Any = None, *, configuration: str | None = None, n: int = 1) -> str:
        """Count ``n`` samples answered by the configuration that ``response`` names (an OpenAI-style reply
        object or dict, or its headers), or by ``configuration``; returns that configuration ("" unnamed)."""
        if configuration is None:
            configuration = configuration_of_response(response)
        self.evaluation.sample(configuration, n)
        return configuration

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        from canaryd.probe.preflight import finish

        assert self.before is not None and self._config is not None and self._started is not None
        pinned, path = _pin(self._pin_path)
        self.record = finish(
            self._config,
            self.before.passed,
            pinned,
            path,
            self.out_dir,
            backend=self.backend,
            post_check=self._post_check,
            started=self._started,
            evaluation=self.evaluation,
            name=self.record_name,
        )

    @property
    def held(self) -> bool | None:
        """Whether the stack and canaries held to the end (None: not checked after, or not ended)."""
        post = (self.record or {}).get("post_run")
        return None if post is None else bool(post["held"])


def configuration_of_response(response: Any) -> str:
    """The serving configuration a provider's reply names: `canaryd.stack.configuration_of` over the
    fields a probe would record from it (`openai_headers.reply_fields`), "" when it names none. Takes what
    a client hands back: a dict, an object with ``model_dump()`` (the OpenAI SDK), or None."""
    from canaryd.backends.openai_headers import reply_fields
    from canaryd.stack import configuration_of

    if response is None:
        return ""
    doc = response.model_dump() if hasattr(response, "model_dump") else response
    if not isinstance(doc, Mapping):
        return ""
    headers = doc.get("headers")
    lowered = {str(k).lower(): str(v) for k, v in headers.items()} if isinstance(headers, Mapping) else {}
    provider = None if doc.get("provider") is None else str(doc["provider"])
    fields = reply_fields(doc.get("model"), doc.get("system_fingerprint"), None, provider, lowered)
    return configuration_of(fields)
