"""The gate around a probe pass: ``check`` (with or without ``--pin``), ``pin`` and ``preflight``.

A pass's exit code is the gate: a request refused as configured (2: fix the profile) beats unreachable (3)
beats drift (1) beats identical (0); against a pin, a pinned field that moved or a pinned backend that
could not be confirmed fails an otherwise clean pass (1). A pass past a backend's daily budget is not sent
(`refuse_over_budget`, exit 3).
``preflight`` runs that gate, starts the benchmark command only when it passes, probes again afterwards
and writes the reproducibility record (``canaryd.report.record``) beside the command's output.

Each function returns a report object (data and an exit code); ``canaryd.report.console`` prints it.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from canaryd import __version__, files
from canaryd.canaries import load_suites
from canaryd.config import Config
from canaryd.errors import EXIT_DRIFT, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE, BudgetSpent, InputError
from canaryd.judge.compare import Verdict
from canaryd.lazy import user_environ
from canaryd.observation import ErrorKind, Observation
from canaryd.probe.budget import over_budget
from canaryd.probe.run import BackendRun, Result, one_pass, plan
from canaryd.report.configurations import Served, over_limit, served
from canaryd.report.pin import Pin, PinnedBackend, PinReport, check_pin
from canaryd.report.record import build_record, summarize, to_markdown
from canaryd.report.tables import result_dict
from canaryd.store import open_store


def gate(results: Sequence[Result]) -> int:
    """The exit code of a probe pass: refused as configured beats unreachable beats drift beats identical."""
    if config_errors(results):
        return EXIT_USAGE
    if any(r.comparison.verdict is Verdict.ERROR for r in results):
        return EXIT_UNAVAILABLE
    if any(r.comparison.verdict.is_drift for r in results):
        return EXIT_DRIFT
    return EXIT_OK


def config_errors(results: Sequence[Result]) -> list[str]:
    """Each distinct refusal of a request as configured, in order: one line naming the backend, the
    parameter and the profile key that fixes it (`canaryd.backends.refusals`)."""
    lines = (r.observation.error for r in results if r.observation.error_kind is ErrorKind.CONFIG)
    return list(dict.fromkeys(line for line in lines if line))


def stacks_now(runs: Sequence[BackendRun]) -> dict[str, dict[str, str]]:
    """Each probed backend's stack in this pass, as its run holds it ({} when no canary got through)."""
    return {run.backend: run.stack for run in runs if run.results}


def configurations_now(runs: Sequence[BackendRun]) -> dict[str, tuple[str, ...]]:
    """Each backend's serving configurations in this pass (those its answers named)."""
    return {b: s.ids for b, s in served(_results(runs)).items()}


def _results(runs: Sequence[BackendRun]) -> tuple[Result, ...]:
    return tuple(r for run in runs for r in run.results)


def pinned_config(config: Config, pin: Pin, pin_path: Path, backend: str | None) -> Config:
    """The config narrowed to the pinned backends: a check against a pin probes what the pin names."""
    names = {b.name for b in config.backends}
    for name in pin.backends:
        if name not in names:
            raise InputError(f"{pin_path}: backend {name!r} is not in {config.path}")
    if backend is not None and backend not in pin.backends:
        raise InputError(f"{pin_path}: backend {backend!r} is not pinned (pinned: {', '.join(pin.backends)})")
    return config.model_copy(update={"backends": tuple(b for b in config.backends if b.name in pin.backends)})


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- check ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PassCheck:
    """One probe pass and, when a pin was given, how the stack compares with it."""

    runs: tuple[BackendRun, ...]
    pin: PinReport | None = None
    max_configurations: int | None = None  # `--max-configurations`: more on a backend fails the pass

    @property
    def results(self) -> tuple[Result, ...]:
        """Every backend's results, in run order."""
        return _results(self.runs)

    @property
    def exit_code(self) -> int:
        code = gate(self.results)
        if code == EXIT_OK and self.pin is not None and not self.pin.matches:
            return EXIT_DRIFT
        if code == EXIT_OK and self.too_many:
            return EXIT_DRIFT
        return code

    @property
    def configurations(self) -> list[Served]:
        """The serving configurations that answered each backend, in result order."""
        return list(served(self.results).values())

    @property
    def too_many(self) -> list[str]:
        """One line per backend served by more configurations than ``max_configurations``."""
        return over_limit(self.configurations, self.max_configurations)

    @property
    def config_errors(self) -> list[str]:
        return config_errors(self.results)

    @property
    def first_error(self) -> Observation | None:
        """The first observation that could not be judged (a backend down or failing)."""
        return next((r.observation for r in self.results if r.comparison.verdict is Verdict.ERROR), None)

    def as_dict(self) -> dict:
        """The ``check --json`` (and ``probe --json``) document."""
        doc: dict = {"exit_code": self.exit_code, "results": [result_dict(r) for r in self.results]}
        if self.config_errors:
            doc["config_errors"] = self.config_errors
        if self.pin is not None:
            doc["pin"] = self.pin.as_dict()
        doc["configurations"] = {s.backend: s.as_dict() for s in self.configurations}
        if self.max_configurations is not None:
            doc["max_configurations"] = {"limit": self.max_configurations, "exceeded": self.too_many}
        return doc


def checked_pass(
    config: Config,
    backend: str | None = None,
    pin: Pin | None = None,
    pin_path: Path | None = None,
    max_configurations: int | None = None,
) -> PassCheck:
    """Probe every (or one) backend once; with a pin, only the pinned backends, and check the pin; with
    ``max_configurations``, a backend served by more configurations fails the pass. A backend whose daily
    budget the pass would pass is not probed at all (`BudgetSpent`, exit 3)."""
    check_limit(max_configurations)
    refuse_over_budget(config, backend)
    if pin is None:
        return PassCheck(tuple(one_pass(config, only=backend)), None, max_configurations)
    if pin_path is None:
        raise ValueError("checked_pass: a pin comes with its path")
    pinned = _pinned_pass(pinned_config(config, pin, pin_path, backend), backend, pin, pin_path)
    return PassCheck(pinned.runs, pinned.pin, max_configurations)


def check_limit(max_configurations: int | None) -> None:
    if max_configurations is not None and max_configurations < 1:
        raise InputError(f"--max-configurations: {max_configurations} is not 1 or more")


def refuse_over_budget(config: Config, only: str | None = None) -> None:
    """Raise `BudgetSpent` when a pass would take a backend past its daily budget (before sending)."""
    budgeted = [
        b
        for b in config.backends
        if only in (None, b.name) and (b.budget_tokens_per_day or b.budget_requests_per_day)
    ]
    if not budgeted:
        return
    work = plan(config, load_suites([s.path for s in config.suites], config.limits.suite_bytes))
    store = open_store(config)
    try:
        for b in budgeted:
            why = over_budget(store, b, work[b.name])
            if why is not None:
                raise BudgetSpent(f"{why}; not probed")
    finally:
        store.close()


def _pinned_pass(config: Config, backend: str | None, pin: Pin, pin_path: Path) -> PassCheck:
    runs = tuple(one_pass(config, only=backend))
    return PassCheck(runs, check_pin(pin, stacks_now(runs), str(pin_path), configurations_now(runs)))


# -- pin ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PinTaken:
    """``canaryd pin``: each backend's stack as it is now, or the failure that left nothing pinned."""

    pin: Pin | None  # None: a backend failed, so nothing was pinned
    failed: Observation | None = None  # the first observation that failed
    drifted: int = 0  # canaries that drifted from their baselines (a note; a pin describes what is)

    @property
    def exit_code(self) -> int:
        if self.pin is not None:
            return EXIT_OK
        return EXIT_USAGE if self.failed and self.failed.error_kind is ErrorKind.CONFIG else EXIT_UNAVAILABLE


def take_pin(config: Config, backend: str | None = None) -> PinTaken:
    """Probe once and pin each backend's stack; its observations are kept in the store as the evidence."""
    checked = PassCheck(tuple(one_pass(config, only=backend)))
    if gate(checked.results) in (EXIT_UNAVAILABLE, EXIT_USAGE):  # a refusal first: it decides the exit
        refused = (r.observation for r in checked.results if r.observation.error_kind is ErrorKind.CONFIG)
        return PinTaken(None, next(refused, checked.first_error))
    runs = {run.backend: run.run_id for run in checked.runs}
    configurations = configurations_now(checked.runs)
    pinned = Pin(
        created=_now(),
        canaryd=__version__,
        backends={
            b: PinnedBackend(config.backend(b).kind, s, runs[b], configurations.get(b, ()))
            for b, s in stacks_now(checked.runs).items()
        },
    )
    store = open_store(config)
    try:
        store.keep([r.observation_id for r in checked.results], "pin")
    finally:
        store.close()
    return PinTaken(pinned, drifted=sum(r.comparison.verdict.is_drift for r in checked.results))


# -- preflight ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PreflightReport:
    """What ``canaryd preflight`` did: the gate, and (when it passed) the command and its record."""

    command: tuple[str, ...]
    check: PassCheck  # the pass before the command, with its pin check
    out_dir: Path
    returncode: int | None = None  # None: the command was not started
    start_error: str | None = None  # why the command could not be started
    record: dict | None = None  # the reproducibility record written to out_dir (when the command ran)
    name: str = "canaryd-record"  # its files: <name>.md and .json

    @property
    def refused(self) -> bool:
        """The gate failed, so the command was not started."""
        return self.check.exit_code != EXIT_OK

    @property
    def held(self) -> bool | None:
        """Whether the stack and canaries held while the command ran (None: no post-check)."""
        post = (self.record or {}).get("post_run")
        return None if post is None else bool(post["held"])

    @property
    def record_path(self) -> Path:
        return self.out_dir / f"{self.name}.md"

    @property
    def exit_code(self) -> int:
        """The gate's code when it failed, 127 when the command could not start, else the command's own
        (128 + N for a command killed by signal N)."""
        if self.refused:
            return self.check.exit_code
        if self.returncode is None:
            return 127
        return self.returncode if self.returncode >= 0 else 128 - self.returncode


def begin(
    config: Config,
    pin: Pin | None,
    pin_path: Path | None,
    *,
    backend: str | None = None,
    max_configurations: int | None = None,
) -> tuple[Config, PassCheck]:
    """The gate a session opens with: probe (the pinned backends, with a pin) and check. When it passes,
    its observations are kept as the session's evidence. The config comes back narrowed to what the
    session watches, for `finish`."""
    check_limit(max_configurations)
    if pin is not None:
        if pin_path is None:
            raise ValueError("begin: a pin comes with its path")
        config = pinned_config(config, pin, pin_path, backend)
        pinned = _pinned_pass(config, backend, pin, pin_path)
        checked = PassCheck(pinned.runs, pinned.pin, max_configurations)
    else:
        refuse_over_budget(config, backend)
        checked = PassCheck(tuple(one_pass(config, only=backend)), None, max_configurations)
    if checked.exit_code == EXIT_OK:
        store = open_store(config)
        try:
            store.keep([r.observation_id for r in checked.results], "preflight")
        finally:
            store.close()
    return config, checked


def finish(
    config: Config,
    checked: PassCheck,
    pin: Pin | None,
    pin_path: Path | None,
    out_dir: Path,
    *,
    backend: str | None = None,
    post_check: bool = True,
    started: datetime,
    command: dict | None = None,
    evaluation: Evaluation | None = None,
    name: str = "canaryd-record",
) -> dict:
    """The end of a session whose `begin` passed: probe again (with ``post_check``), record the session in
    the store and write ``<name>.json`` and ``.md`` into ``out_dir``; the record."""
    finished = datetime.now(UTC)
    after = _results(one_pass(config, only=backend)) if post_check else ()
    runs = sorted(run.run_id for run in checked.runs if run.results)
    where = "" if pin_path is None else str(pin_path)
    ev = evaluation or Evaluation(harness=Path(command["argv"][0]).name if command else "")
    store = open_store(config)
    try:
        store.keep([r.observation_id for r in after], "preflight")
        post = None
        if after:
            post = summarize(build_record(store, sorted({r.run_id for r in after}), pin=pin, pin_path=where))
        store.save_session(
            started_at=started,
            finished_at=finished,
            harness=ev.harness,
            task=ev.task,
            samples=ev.samples,
            configurations=ev.configurations,
            runs_before=runs,
            runs_after=sorted({r.run_id for r in after}),
            held=None if post is None else bool(post["held"]),
            out_dir=str(out_dir),
        )
        rec = build_record(store, runs, pin=pin, pin_path=where, version=__version__)  # with the session
    finally:
        store.close()
    if command is not None:
        rec["command"] = {
            "argv": command["argv"],
            "cwd": command["cwd"],
            "started": _iso(started),
            "finished": _iso(finished),
            "exit_code": command["exit_code"],
            **({"results": command["results"]} if "results" in command else {}),
        }
    if post is not None:
        rec["post_run"] = post
    out_dir.mkdir(parents=True, exist_ok=True)
    files.write_private(out_dir / f"{name}.json", json.dumps(rec, indent=2, ensure_ascii=False) + "\n")
    files.write_private(out_dir / f"{name}.md", to_markdown(rec))
    return rec


@dataclass
class Evaluation:
    """What a harness ran in a session: its name, the task, and the serving configuration of each sample
    (from what the provider returned with it: no extra request)."""

    harness: str = ""
    task: str = ""
    configurations: dict[str, int] = field(default_factory=dict)  # configuration ("" unnamed) → samples

    @property
    def samples(self) -> int:
        return sum(self.configurations.values())

    def sample(self, configuration: str = "", n: int = 1) -> None:
        self.configurations[configuration] = self.configurations.get(configuration, 0) + n

    def as_dict(self) -> dict:
        return {
            "harness": self.harness,
            "task": self.task,
            "samples": self.samples,
            "configurations": dict(sorted(self.configurations.items())),
        }


def _iso(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def run_preflight(
    config: Config,
    pin: Pin,
    pin_path: Path,
    command: Sequence[str],
    out_dir: Path,
    *,
    backend: str | None = None,
    post_check: bool = True,
    on_checked: Callable[[PassCheck], None] | None = None,
    max_configurations: int | None = None,
) -> PreflightReport:
    """Probe and check the pin; if nothing moved, run ``command`` as a session (`begin`, the command,
    `finish`): probe again (with ``post_check``) and write the record into ``out_dir``.

    ``on_checked`` sees the first pass before the command starts (the CLI prints its tables there).
    """
    config, checked = begin(config, pin, pin_path, backend=backend, max_configurations=max_configurations)
    if on_checked is not None:
        on_checked(checked)
    argv = tuple(command)
    if checked.exit_code != EXIT_OK:
        return PreflightReport(argv, checked, out_dir)
    started = datetime.now(UTC)
    from canaryd.harnesses.lm_eval import read_results, written_since

    try:
        # the command runs as it would without canaryd: the user's umask (canaryd's own is 0077: files.py)
        # and environment (`lazy.user_environ`)
        umask = files.original_umask if files.original_umask is not None else -1
        returncode = subprocess.run(list(argv), check=False, umask=umask, env=user_environ()).returncode
    except OSError as e:
        return PreflightReport(argv, checked, out_dir, start_error=str(e.strerror or e))
    command_doc = {"argv": list(argv), "cwd": str(Path.cwd()), "exit_code": returncode}
    # an lm-eval run's results file: the record goes beside it, named after it, and cites it
    found = [r for p in written_since(out_dir, started.timestamp() - 1) if (r := read_results(p))]
    results = found[-1] if found else None
    if results is not None:
        command_doc["results"] = results.as_dict()
    rec = finish(
        config,
        checked,
        pin,
        pin_path,
        results.path.parent if results else out_dir,
        backend=backend,
        post_check=post_check,
        started=started,
        command=command_doc,
        # lm-eval keeps the answers' text, not the replies that named a configuration: samples unnamed
        evaluation=Evaluation("lm-eval", ",".join(results.tasks), {"": results.samples}) if results else None,
        name=f"canaryd-record.{results.path.stem}" if results else "canaryd-record",
    )
    if results is None:
        return PreflightReport(argv, checked, out_dir, returncode, record=rec)
    name = f"canaryd-record.{results.path.stem}"
    return PreflightReport(argv, checked, results.path.parent, returncode, record=rec, name=name)
