"""The ``canaryd`` command line.

Exit codes (also in ``canaryd --help`` and the README):

0  every canary identical to its baseline (or a new baseline was recorded)
1  drift: a regression, answer drift, logprob drift or stack change
2  bad config, canary file or usage (also a metrics address in use, an unusable state_dir or storage.url)
3  a backend was unreachable or failing, so it could not be judged
4  internal or storage error (a bug or a broken database: see the log)

``preflight`` exits 1 or 3 as ``check --pin`` would, without running its command; once the canaries pass,
it exits with the command's own exit code.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import structlog
import typer
from rich.console import Console
from sqlalchemy.exc import SQLAlchemyError

from canaryd import __version__
from canaryd import log as logsetup
from canaryd.canaries import load_suites, risky_patterns
from canaryd.config import Config, find_config, load_config
from canaryd.errors import EXIT_DRIFT, EXIT_INTERNAL, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE, InputError
from canaryd.fields import parse_duration, since_time
from canaryd.files import private_umask, write_private
from canaryd.report.pin import load_pin

if TYPE_CHECKING:
    from canaryd.store import Store

app = typer.Typer(
    help="Known-answer canaries for LLM serving stacks.\n\n"
    "Exit codes: 0 identical, 1 drift, 2 bad config/usage, 3 backend unreachable, 4 internal error.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
baseline_app = typer.Typer(help="Manage baselines.", no_args_is_help=True)
app.add_typer(baseline_app, name="baseline")
out = Console(soft_wrap=False, width=160)


class State:
    config_path: Path | None = None
    log_level: str | None = None


def _version(value: bool) -> None:
    if value:
        print(f"canaryd {__version__} (python {sys.version.split()[0]})")
        raise typer.Exit()


@app.callback()
def _main(
    ctx: typer.Context,
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="Config file (default: search).")
    ] = None,
    log_level: Annotated[
        str | None, typer.Option(help="debug, info, warning or error [default: warning; info for run].")
    ] = None,
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True)] = False,
) -> None:
    if log_level is not None and log_level.lower() not in ("debug", "info", "warning", "error"):
        raise InputError(f"--log-level: unknown level {log_level!r} (debug, info, warning, error)")
    logsetup.configure(log_level or "warning")
    ctx.obj = State()
    ctx.obj.config_path, ctx.obj.log_level = config, log_level


def _config(ctx: typer.Context) -> Config:
    return load_config(find_config(ctx.obj.config_path))


@contextmanager
def _store(cfg: Config) -> Iterator[Store]:
    from canaryd.store import open_store

    store = open_store(cfg)
    try:
        yield store
    finally:
        store.close()


@app.command()
def check(
    ctx: typer.Context,
    backend: Annotated[str | None, typer.Option(help="Only this backend.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")] = False,
    pin: Annotated[
        Path | None,
        typer.Option(help="Also fail (exit 1) when a field pinned in this file moved or is gone."),
    ] = None,
) -> None:
    """Probe, compare with the baselines, and exit 0/1/3 (the gate for CI and benchmark sessions)."""
    from canaryd.probe.preflight import checked_pass
    from canaryd.report.console import show_pass

    pinned = load_pin(pin) if pin is not None else None
    passed = checked_pass(_config(ctx), backend, pinned, pin)
    show_pass(passed, as_json, out)
    raise typer.Exit(passed.exit_code)


@app.command()
def probe(
    ctx: typer.Context,
    backend: Annotated[str | None, typer.Option(help="Only this backend.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")] = False,
) -> None:
    """Send every canary through every backend and record the observations (exit 3 if one was down)."""
    from canaryd.probe.preflight import checked_pass
    from canaryd.report.console import show_pass

    passed = checked_pass(_config(ctx), backend)
    show_pass(passed, as_json, out)
    raise typer.Exit(EXIT_UNAVAILABLE if passed.exit_code == EXIT_UNAVAILABLE else EXIT_OK)


@app.command("census")
def census_cmd(
    ctx: typer.Context,
    backend: Annotated[str | None, typer.Option(help="Only this backend (default: every one).")] = None,
    canary: Annotated[
        list[str] | None, typer.Option("--canary", help="A canary id (repeatable; default: all).")
    ] = None,
    requests: Annotated[int, typer.Option("--requests", "-n", help="Probes per batch size.")] = 20,
    batch_sizes: Annotated[
        str, typer.Option(help="Comma-separated batch sizes; 1 means alone, b means with b-1 fillers.")
    ] = "1,8,32",
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")] = False,
    output: Annotated[Path | None, typer.Option(help="Also write the JSON report here.")] = None,
    strict: Annotated[
        bool, typer.Option(help="Exit 1 when a canary is not deterministic or not batch-invariant.")
    ] = False,
) -> None:
    """Nondeterminism census: N identical probes per canary, alone and in crowded batches (nothing stored)."""
    from canaryd.probe.census import parse_batch_sizes, take_census
    from canaryd.report.console import show_census

    sizes = parse_batch_sizes(batch_sizes)
    if not 1 <= requests <= 100_000:
        raise InputError(f"--requests: {requests} is not from 1 to 100000")
    report = take_census(
        _config(ctx), backend=backend, canary_ids=canary, requests=requests, sizes=sizes, strict=strict
    )
    show_census(report, as_json, out, output)
    raise typer.Exit(report.exit_code)


@app.command("pin")
def pin_cmd(
    ctx: typer.Context,
    backend: Annotated[str | None, typer.Option(help="Only this backend.")] = None,
    out_file: Annotated[Path | None, typer.Option("--out", help="Write here (default: stdout).")] = None,
) -> None:
    """Probe once and write each backend's stack as it is now: a lock file for `check --pin`/`preflight`."""
    from canaryd.probe.preflight import take_pin
    from canaryd.report.console import show_pin

    taken = take_pin(_config(ctx), backend)
    show_pin(taken, out_file)
    raise typer.Exit(taken.exit_code)


@app.command(context_settings={"allow_interspersed_args": False})
def preflight(
    ctx: typer.Context,
    command: Annotated[list[str], typer.Argument(help="The benchmark command (after --).")],
    pin: Annotated[Path, typer.Option(help="The pin file the stack must still match.")],
    out_dir: Annotated[Path, typer.Option("--out", help="Where canaryd-record.json and .md go.")] = Path("."),
    backend: Annotated[str | None, typer.Option(help="Only this pinned backend.")] = None,
    post_check: Annotated[
        bool, typer.Option(help="Probe again after the command, so the record says whether it held.")
    ] = True,
) -> None:
    """Run the canaries; if nothing moved, run COMMAND and write the reproducibility record beside it.

    Refuses to start COMMAND (exit 1) on any drift verdict or moved pin field, exit 3 if a backend is
    unreachable; otherwise exits with COMMAND's exit code. Tables go to stderr: stdout is COMMAND's.
    """
    from canaryd.probe.preflight import run_preflight
    from canaryd.report.console import show_pass, show_preflight

    pinned = load_pin(pin)
    show = partial(show_pass, as_json=False, console=Console(stderr=True, soft_wrap=False, width=160))
    report = run_preflight(
        _config(ctx), pinned, pin, command, out_dir, backend=backend, post_check=post_check, on_checked=show
    )
    show_preflight(report)
    raise typer.Exit(report.exit_code)


@app.command()
def explain(
    ctx: typer.Context,
    backend: Annotated[str, typer.Argument(help="The backend.")],
    canary: Annotated[
        str | None, typer.Argument(help="One canary (default: every canary that flipped).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """The last flip: last good and first bad observation side by side, what moved, what to revert."""
    from canaryd.report.console import show_explain
    from canaryd.report.record import explain as explain_flips

    with _store(_config(ctx)) as store:
        doc = explain_flips(store, backend, canary)
    show_explain(doc, as_json)


def _write(text: str, path: Path | None) -> None:
    if path is None:
        sys.stdout.write(text)
    else:
        write_private(path, text)


@app.command("record")
def record_cmd(
    ctx: typer.Context,
    run: Annotated[list[int] | None, typer.Option("--run", help="A run id (repeatable).")] = None,
    since: Annotated[str | None, typer.Option(help="Every run since: ISO 8601 time or duration.")] = None,
    pin: Annotated[Path | None, typer.Option(help="Say whether the session matched this pin.")] = None,
    fmt: Annotated[str, typer.Option("--format", help="md or json.")] = "md",
    out_file: Annotated[Path | None, typer.Option("--out", help="Write here (default: stdout).")] = None,
    html: Annotated[Path | None, typer.Option("--html", help="Also write the HTML report here.")] = None,
) -> None:
    """The reproducibility record of a session, from the store: stack, pin, canaries, changes, pointers."""
    from canaryd.report.record import record_of, to_markdown

    if (not run) == (since is None):
        raise InputError("record: give either --run ID (repeatable) or --since TIME")
    if fmt not in ("md", "json"):
        raise InputError(f"--format: {fmt!r} is not md or json")
    pinned = load_pin(pin) if pin is not None else None
    with _store(_config(ctx)) as store:
        run_ids = run or store.run_ids(since_time(since))  # type: ignore[arg-type]
        rec = record_of(store, run_ids, since, pinned, str(pin or ""))
        if html is not None:
            from canaryd.report.html import write_report

            write_report(store, run_ids, html)
    _write(
        json.dumps(rec, indent=2, ensure_ascii=False) + "\n" if fmt == "json" else to_markdown(rec), out_file
    )


@app.command()
def prune(
    ctx: typer.Context,
    older_than: Annotated[str, typer.Option(help="Age, e.g. 30d or 12h.")],
    dry_run: Annotated[bool, typer.Option(help="Count what would go; delete nothing.")] = False,
) -> None:
    """Delete observations older than the given age (never baselines, pinned or recorded ones)."""
    from canaryd.report.console import show_pruned

    try:
        cutoff = datetime.now(UTC) - timedelta(seconds=parse_duration(older_than))
    except ValueError as e:
        raise InputError(f"--older-than: {e}") from None
    with _store(_config(ctx)) as store:
        counts = store.prune(cutoff, dry_run=dry_run)
    show_pruned(counts, cutoff, dry_run)


@app.command()
def export(
    ctx: typer.Context,
    run: Annotated[list[int], typer.Option("--run", help="A run id (repeatable).")],
    out_file: Annotated[Path | None, typer.Option("--out", help="Write here (default: stdout).")] = None,
) -> None:
    """A run's raw observations as JSON lines: every field, tokens, logprobs, top-k and the stack."""
    from canaryd.report.record import export_lines

    with _store(_config(ctx)) as store:
        _write(export_lines(store, run), out_file)


@app.command()
def run(ctx: typer.Context) -> None:
    """Run the daemon: probe on the configured schedules and serve Prometheus metrics."""
    from canaryd.daemon import signals

    # First of all (again, if `python -m canaryd run` already did): a SIGTERM during start-up (the store's
    # migration, suites, backends) is remembered and stops the daemon cleanly, right after start-up.
    stop, _ = signals.install()
    from canaryd.daemon.service import run_daemon

    if ctx.obj.log_level is None:
        logsetup.configure("info")  # a daemon logs its observations unless told otherwise
    run_daemon(find_config(ctx.obj.config_path), stop)


@app.command()
def validate(ctx: typer.Context) -> None:
    """Check the config and every canary file without probing anything."""
    cfg = _config(ctx)
    suites = load_suites([s.path for s in cfg.suites], cfg.limits.suite_bytes)
    n = sum(len(s.canaries) for s in suites)
    for line in risky_patterns(suites):  # a warning, not an error: the check's time bound contains them
        logsetup.to_stderr(f"canaryd: warning: {line}", "warning")
    print(f"{cfg.path}: ok: {len(cfg.backends)} backend(s), {len(suites)} suite(s), {n} canaries")


@app.command("diff")
def diff_cmd(
    ctx: typer.Context,
    runs: Annotated[
        list[int],
        typer.Argument(
            metavar="RUN_A RUN_B", help="Run ids in pairs, A B [C D ...] (`check --json` shows run_id)."
        ),
    ],
    label: Annotated[
        list[str] | None, typer.Option("--label", help="A column name per pair, in order (repeatable).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")] = False,
    html: Annotated[Path | None, typer.Option("--html", help="Also write the HTML report here.")] = None,
) -> None:
    """Diff runs answer by answer and step by step: changes, flips, scores per suite, fingerprints, stacks.

    Exit 0 when no answer or step changed in any pair, 1 when one did (like diff(1)).
    """
    from canaryd.report.console import show_diff
    from canaryd.report.rundiff import diff_pairs

    if len(runs) % 2:
        raise InputError(f"diff: run ids come in pairs (A B [C D ...]), got {len(runs)}")
    if label and len(label) != len(runs) // 2:
        raise InputError(f"--label: {len(label)} label(s) for {len(runs) // 2} pair(s) of runs")
    with _store(_config(ctx)) as store:
        diffs = diff_pairs(store, runs, label)
        if html is not None:
            from canaryd.report.html import write_report
            from canaryd.report.rundiff import pairs_of

            write_report(store, runs, html, pairs_of(runs), label)
    code = EXIT_DRIFT if any(d.changed for d in diffs) else EXIT_OK
    show_diff(diffs, code, as_json, out)
    raise typer.Exit(code)


@app.command("report")
def report_cmd(
    ctx: typer.Context,
    runs: Annotated[
        list[int], typer.Argument(metavar="RUN...", help="Run ids: each diffed against the one before.")
    ],
    out_file: Annotated[Path, typer.Option("--out", help="The HTML file.")] = Path("canaryd-report.html"),
) -> None:
    """One self-contained HTML file (no server, no network): summary, token diffs, history, stack, record."""
    from canaryd.report.html import write_report

    with _store(_config(ctx)) as store:
        size = write_report(store, runs, out_file)
    print(f"{out_file}: {size} bytes")


@app.command()
def history(
    ctx: typer.Context,
    backend: Annotated[str | None, typer.Option(help="Only this backend.")] = None,
    canary: Annotated[str | None, typer.Option(help="Only this canary.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=100000)] = 50,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Stored observations, newest first."""
    from canaryd.report.console import show_history

    with _store(_config(ctx)) as store:
        rows = store.observations(backend=backend, canary_id=canary, limit=limit)
    show_history(rows, as_json, out)


@app.command()
def stack(
    ctx: typer.Context,
    backend: Annotated[str | None, typer.Option(help="Only this backend.")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Every distinct serving stack each backend has shown, and what changed between them."""
    from canaryd.report.console import show_stacks

    with _store(_config(ctx)) as store:
        stacks = store.stacks(backend)
    show_stacks(stacks, as_json, out)


@baseline_app.command("accept")
def baseline_accept(
    ctx: typer.Context,
    backend: Annotated[str | None, typer.Option(help="Only this backend.")] = None,
    canary: Annotated[
        str | None, typer.Option(help="Only this canary (a chained one: all its steps).")
    ] = None,
) -> None:
    """Make the latest successful observation the baseline (after an intended change)."""
    from canaryd.report.console import show_accepted

    cfg = _config(ctx)
    if backend is not None:
        cfg.backend(backend)
    with _store(cfg) as store:
        accepted = store.accept_latest(backend, canary)
        # a noise model measured on the old stack would call the new one "out" forever
        dropped = store.drop_calibrations([(a.backend, a.canary_id) for a in accepted])
    show_accepted(accepted, dropped)
    if not accepted:
        raise InputError("baseline accept: no successful observation matches; run `canaryd probe` first")


@baseline_app.command("calibrate")
def baseline_calibrate(
    ctx: typer.Context,
    backend: Annotated[str | None, typer.Option(help="Only this backend.")] = None,
    canary: Annotated[
        list[str] | None, typer.Option("--canary", help="A canary id (repeatable; default: all).")
    ] = None,
    k: Annotated[
        int | None, typer.Option("-k", help="Probes per canary (default: [compare] calibration_k).")
    ] = None,
    batch_sizes: Annotated[
        str | None,
        typer.Option(help="Load levels, e.g. 1,8 (default: [compare] calibration_batch_sizes)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")] = False,
) -> None:
    """Learn each canary's honest noise (K probes, alone and in crowded batches); exit 1 if a baseline
    lies outside it."""
    from canaryd.probe.calibrate import calibrate_config
    from canaryd.probe.census import parse_batch_sizes
    from canaryd.report.console import show_calibration

    cfg = _config(ctx)
    if backend is not None:
        cfg.backend(backend)  # an unknown name is an InputError, before a bad --batch-sizes
    sizes = parse_batch_sizes(batch_sizes) if batch_sizes is not None else None
    report = calibrate_config(cfg, backend=backend, canary_ids=canary, k=k, batch_sizes=sizes)
    show_calibration(report, as_json, out)
    raise typer.Exit(report.exit_code)


db_app = typer.Typer(help="The history database's schema (Alembic migrations).", no_args_is_help=True)
app.add_typer(db_app, name="db")


@db_app.command("upgrade")
def db_upgrade(ctx: typer.Context) -> None:
    """Migrate the database to this canaryd's schema (every command and the daemon also do it at start)."""
    from canaryd.report.console import show_migration
    from canaryd.store import upgrade_database

    show_migration(*upgrade_database(_config(ctx)))


@db_app.command("current")
def db_current(
    ctx: typer.Context,
    check: Annotated[bool, typer.Option("--check", help="Exit 1 unless the database is at head.")] = False,
) -> None:
    """Print the database's schema revision (changes nothing)."""
    from canaryd.report.console import show_revision
    from canaryd.store import database_revision
    from canaryd.store.engine import SCHEMA_REVISION, known_revisions

    rev = database_revision(_config(ctx))
    show_revision(rev, SCHEMA_REVISION, known_revisions())
    if check and rev != SCHEMA_REVISION:
        raise typer.Exit(EXIT_DRIFT)


@app.command()
def init(
    path: Annotated[Path, typer.Argument(help="Where to write the config.")] = Path("canaryd.toml"),
    force: Annotated[bool, typer.Option(help="Overwrite an existing file.")] = False,
) -> None:
    """Write a commented example config (and a copy of the default canary suite beside it)."""
    from canaryd.scaffold import write_example

    for written in write_example(path, force=force):
        print(f"wrote {written}")


ops_app = typer.Typer(help="Operations files shipped in the package.", no_args_is_help=True)
app.add_typer(ops_app, name="ops")


@ops_app.command("export")
def ops_export(
    dest: Annotated[Path, typer.Argument(help="Directory to write them under (created if missing).")],
    force: Annotated[bool, typer.Option(help="Overwrite existing files.")] = False,
) -> None:
    """Write the alert rules and their tests, the Grafana dashboard, the systemd unit and the runbook."""
    from canaryd.ops import export_files

    for written in export_files(dest, force=force):
        print(f"wrote {written}")


@app.command()
def demo(
    workdir: Annotated[Path, typer.Option(help="Where the tiny model, config and database go.")] = Path(
        ".canaryd-demo"
    ),
) -> None:
    """Build a tiny model, serve it with vLLM, and show probe → baseline → silent shift → drift verdict."""
    from canaryd.demo import run_demo

    raise typer.Exit(run_demo(workdir, out))


def main() -> None:
    private_umask()  # what canaryd creates (history, WAL, exports, pins, records) is its owner's alone
    log = structlog.get_logger("canaryd")
    try:
        app()  # usage errors exit 2 and typer.Exit(code) exits with code, as SystemExit
    except InputError as e:
        logsetup.to_stderr(f"canaryd: error: {e}", "error")
        sys.exit(EXIT_USAGE)
    except SQLAlchemyError as e:
        logsetup.to_stderr(f"canaryd: storage error: {str(e).splitlines()[0]}", "error")
        sys.exit(EXIT_INTERNAL)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # the last line of defence: one line, no traceback unless debugging
        log.debug("internal_error", exc_info=True)
        logsetup.to_stderr(f"canaryd: internal error: {e.__class__.__name__}: {e}", "error")
        sys.exit(EXIT_INTERNAL)
