"""The ``canaryd`` command line.

Exit codes (also in ``canaryd --help`` and the README):

0  every canary identical to its baseline (or a new baseline was recorded)
1  drift: a regression, answer drift, logprob drift or stack change
2  bad config, canary file or usage (also a metrics address in use, an unusable state_dir or storage.url),
   or a backend refused a request as configured (an unsupported parameter or value: one line names the
   backend, the parameter and the request-profile key that fixes it)
3  a backend was unreachable or failing, or its daily budget is spent, so it could not be judged
4  internal or storage error (a bug or a broken database: see the log)

``preflight`` exits 1 or 3 as ``check --pin`` would, without running its command; once the canaries pass,
it exits with the command's own exit code.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Annotated

import typer

from canaryd import __version__
from canaryd.commands import (
    JsonFlag,
    State,
    WholeHelpGroup,
    baseline,
    console,
    db,
    doctor,
    emit,
    hoist_global_options,
    load,
    ops,
    reader_of,
    report,
    show_progress,
    store_of,
)
from canaryd.errors import (
    EXIT_DRIFT,
    EXIT_INTERNAL,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    BudgetSpent,
    InputError,
)

# Plain help (no rich markup): every bracket and default shows as written, and rich stays unimported.
app = typer.Typer(
    help="Known-answer canaries for LLM serving stacks.\n\n"
    "Exit codes: 0 identical, 1 drift, 2 bad config/usage or a request refused as configured, "
    "3 backend unreachable or over budget, 4 internal error.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    cls=WholeHelpGroup,
)
MaxConfigurations = Annotated[
    int | None,
    typer.Option(
        metavar="N",
        help="Also fail (exit 1) when a backend was served by more than N serving configurations.",
    ),
]
# Commands whose work never logs: they set up logging (and import structlog) only if something does.
_QUIET = ("validate", "init")


def _version(value: bool) -> None:
    if value:
        print(f"canaryd {__version__} (python {sys.version.split()[0]})")
        raise typer.Exit()


@app.callback()
def _main(
    ctx: typer.Context,
    config: Annotated[
        Path | None,
        typer.Option("--config", "-c", help="Config file (default: search); before or after the command."),
    ] = None,
    log_level: Annotated[
        str | None, typer.Option(help="debug, info, warning or error [default: warning; info for run].")
    ] = None,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    if log_level is not None and log_level.lower() not in ("debug", "info", "warning", "error"):
        raise InputError(f"--log-level: unknown level {log_level!r} (debug, info, warning, error)")
    from canaryd import lazy

    lazy.on_first_log(partial(_configure_logging, log_level or "warning"))
    if ctx.invoked_subcommand not in _QUIET and not State.help_asked:
        lazy.set_up_logging()  # now: the command's modules log through structlog directly
    ctx.obj = State()
    ctx.obj.config_path, ctx.obj.log_level = config, log_level


@app.command()
def check(
    ctx: typer.Context,
    backend: Annotated[str | None, typer.Option(help="Only this backend.")] = None,
    as_json: JsonFlag = False,
    pin: Annotated[
        Path | None,
        typer.Option(help="Also fail (exit 1) when a field pinned in this file moved or is gone."),
    ] = None,
    max_configurations: MaxConfigurations = None,
) -> None:
    """Probe, compare with the baselines, and exit 0/1/2/3 (the gate for CI and benchmark sessions)."""
    from canaryd.progress import shown
    from canaryd.report.pin import load_pin

    pinned = load_pin(pin) if pin is not None else None
    with shown("probing", "canaries", enabled=show_progress(as_json)):
        from canaryd.probe.preflight import checked_pass

        passed = checked_pass(load(ctx), backend, pinned, pin, max_configurations)
    from canaryd.report.console import show_pass

    show_pass(passed, as_json, console())
    raise typer.Exit(passed.exit_code)


@app.command()
def probe(
    ctx: typer.Context,
    backend: Annotated[str | None, typer.Option(help="Only this backend.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Send every canary through every backend and record the observations (exit 3 if one was down, 2 if
    one refused a request as configured)."""
    from canaryd.progress import shown

    with shown("probing", "canaries", enabled=show_progress(as_json)):
        from canaryd.probe.preflight import checked_pass

        passed = checked_pass(load(ctx), backend)
    from canaryd.report.console import show_pass

    code = passed.exit_code if passed.exit_code in (EXIT_USAGE, EXIT_UNAVAILABLE) else EXIT_OK
    show_pass(passed, as_json, console(), exit_code=code)
    raise typer.Exit(code)


@app.command("census")
def census_cmd(
    ctx: typer.Context,
    backend: Annotated[str | None, typer.Option(help="Only this backend (default: every one).")] = None,
    canary: Annotated[
        list[str] | None,
        typer.Option("--canary", metavar="ID", help="A canary id (repeatable; default: all)."),
    ] = None,
    requests: Annotated[int, typer.Option("--requests", "-n", help="Probes per batch size.")] = 20,
    batch_sizes: Annotated[
        str, typer.Option(help="Comma-separated batch sizes; 1 means alone, b means with b-1 fillers.")
    ] = "1,8,32",
    as_json: JsonFlag = False,
    output: Annotated[Path | None, typer.Option(help="Also write the JSON report here.")] = None,
    strict: Annotated[
        bool, typer.Option(help="Exit 1 when a canary is not deterministic or not batch-invariant.")
    ] = False,
) -> None:
    """Nondeterminism census: N identical probes per canary, alone and in crowded batches (nothing stored)."""
    from canaryd.progress import shown

    if not 1 <= requests <= 100_000:
        raise InputError(f"--requests: {requests} is not from 1 to 100000")
    with shown("census:", "probes", enabled=show_progress(as_json)):  # shown before the heavy imports
        from canaryd.probe.census import parse_batch_sizes, take_census

        sizes = parse_batch_sizes(batch_sizes)
        report = take_census(
            load(ctx), backend=backend, canary_ids=canary, requests=requests, sizes=sizes, strict=strict
        )
    from canaryd.report.console import show_census

    show_census(report, as_json, console(), output)
    raise typer.Exit(report.exit_code)


@app.command("pin")
def pin_cmd(
    ctx: typer.Context,
    backend: Annotated[str | None, typer.Option(help="Only this backend.")] = None,
    out_file: Annotated[Path | None, typer.Option("--out", help="Write here (default: stdout).")] = None,
) -> None:
    """Probe once and write each backend's stack as it is now: a lock file for `check --pin`/`preflight`."""
    from canaryd.progress import shown

    with shown("probing", "canaries"):  # stderr only: the pin itself may go to stdout
        from canaryd.probe.preflight import take_pin

        taken = take_pin(load(ctx), backend)
    from canaryd.report.console import show_pin

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
    max_configurations: MaxConfigurations = None,
) -> None:
    """Run the canaries; if nothing moved, run COMMAND and write the reproducibility record beside it.

    Refuses to start COMMAND (exit 1) on any drift verdict or moved pin field, exit 3 if a backend is
    unreachable; otherwise exits with COMMAND's exit code. Tables go to stderr: stdout is COMMAND's.
    """
    from canaryd.probe.preflight import run_preflight
    from canaryd.report.console import show_pass, show_preflight
    from canaryd.report.pin import load_pin

    pinned = load_pin(pin)
    show = partial(show_pass, as_json=False, console=console(stderr=True))
    report = run_preflight(
        load(ctx),
        pinned,
        pin,
        command,
        out_dir,
        backend=backend,
        post_check=post_check,
        on_checked=show,
        max_configurations=max_configurations,
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
    as_json: JsonFlag = False,
) -> None:
    """The last flip: last good and first bad observation side by side, what moved, what to revert."""
    from canaryd.report.console import show_explain
    from canaryd.report.record import explain as explain_flips

    with reader_of(load(ctx)) as store:
        doc = explain_flips(store, backend, canary)
    show_explain(doc, as_json)


def _write(text: str, path: Path | None) -> None:
    if path is None:
        sys.stdout.write(text)
    else:
        from canaryd.files import write_private

        write_private(path, text)


@app.command("record")
def record_cmd(
    ctx: typer.Context,
    run: Annotated[
        list[int] | None, typer.Option("--run", metavar="RUN_ID", help="A run id (repeatable).")
    ] = None,
    since: Annotated[str | None, typer.Option(help="Every run since: ISO 8601 time or duration.")] = None,
    pin: Annotated[Path | None, typer.Option(help="Say whether the session matched this pin.")] = None,
    fmt: Annotated[str, typer.Option("--format", help="md or json.")] = "md",
    out_file: Annotated[Path | None, typer.Option("--out", help="Write here (default: stdout).")] = None,
    html: Annotated[Path | None, typer.Option("--html", help="Also write the HTML report here.")] = None,
) -> None:
    """The reproducibility record of a session, from the store: stack, pin, canaries, changes, pointers."""
    import json

    from canaryd.fields import since_time
    from canaryd.report.pin import load_pin
    from canaryd.report.record import record_of, to_markdown

    if (not run) == (since is None):
        raise InputError("record: give either --run ID (repeatable) or --since TIME")
    if fmt not in ("md", "json"):
        raise InputError(f"--format: {fmt!r} is not md or json")
    pinned = load_pin(pin) if pin is not None else None
    with reader_of(load(ctx)) as store:
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
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Count what would go; delete nothing.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Delete observations older than the given age (never baselines, pinned or recorded ones)."""
    from datetime import UTC, datetime, timedelta

    from canaryd.fields import parse_duration
    from canaryd.report.console import show_pruned

    try:
        cutoff = datetime.now(UTC) - timedelta(seconds=parse_duration(older_than))
    except ValueError as e:
        raise InputError(f"--older-than: {e}") from None
    with reader_of(load(ctx)) if dry_run else store_of(load(ctx)) as store:
        counts = store.prune(cutoff, dry_run=dry_run)
    show_pruned(counts, cutoff, dry_run, as_json)


@app.command()
def export(
    ctx: typer.Context,
    run: Annotated[list[int], typer.Option("--run", metavar="RUN_ID", help="A run id (repeatable).")],
    out_file: Annotated[Path | None, typer.Option("--out", help="Write here (default: stdout).")] = None,
) -> None:
    """A run's raw observations as JSON lines: every field, tokens, logprobs, top-k and the stack."""
    from canaryd.report.record import export_lines

    with reader_of(load(ctx)) as store:
        _write(export_lines(store, run), out_file)


@app.command()
def run(ctx: typer.Context) -> None:
    """Run the daemon: probe on the configured schedules and serve Prometheus metrics."""
    from canaryd.daemon import signals

    # First of all (again, if `python -m canaryd run` already did): a SIGTERM during start-up (the store's
    # migration, suites, backends) is remembered and stops the daemon cleanly, right after start-up.
    stop, _ = signals.install()
    from canaryd import log as logsetup
    from canaryd.config import find_config
    from canaryd.daemon.service import run_daemon

    if ctx.obj.log_level is None:
        logsetup.configure("info")  # a daemon logs its observations unless told otherwise
    run_daemon(find_config(ctx.obj.config_path), stop)


@app.command()
def validate(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """Check the config and every canary file without probing anything."""
    from canaryd.backends.base import cannot_score
    from canaryd.backends.profile import without_completions
    from canaryd.canaries import load_suites, risky_patterns

    cfg = load(ctx)
    suites = load_suites([s.path for s in cfg.suites], cfg.limits.suite_bytes)
    if (why := without_completions(cfg, suites) or cannot_score(cfg, suites)) is not None:
        raise InputError(why)
    n = sum(len(s.canaries) for s in suites)
    warnings = risky_patterns(suites)  # warnings, not errors: the check's time bound contains them
    if warnings:
        from canaryd.log import to_stderr

        for line in warnings:
            to_stderr(f"canaryd: warning: {line}", "warning")
    if as_json:
        emit(
            {
                "exit_code": EXIT_OK,
                "config": str(cfg.path),
                "backends": [b.name for b in cfg.backends],
                "suites": [s.name for s in suites],
                "canaries": n,
                "warnings": list(warnings),
            }
        )
        return
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
        list[str] | None,
        typer.Option("--label", metavar="LABEL", help="A column name per pair, in order (repeatable)."),
    ] = None,
    as_json: JsonFlag = False,
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
    with reader_of(load(ctx)) as store:
        diffs = diff_pairs(store, runs, label)
        if html is not None:
            from canaryd.report.html import write_report
            from canaryd.report.rundiff import pairs_of

            write_report(store, runs, html, pairs_of(runs), label)
    code = EXIT_DRIFT if any(d.changed for d in diffs) else EXIT_OK
    show_diff(diffs, code, as_json, console())
    raise typer.Exit(code)


@app.command()
def history(
    ctx: typer.Context,
    backend: Annotated[str | None, typer.Option(help="Only this backend.")] = None,
    canary: Annotated[str | None, typer.Option(help="Only this canary.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=100000, help="At most this many.")] = 50,
    as_json: JsonFlag = False,
) -> None:
    """Stored observations, newest first, with the tokens each cost and each backend's spend today."""
    from canaryd.probe.budget import day_start
    from canaryd.report.console import show_history

    with reader_of(load(ctx)) as store:
        rows = store.observations(backend=backend, canary_id=canary, limit=limit)
        names = dict.fromkeys(r.backend for r in rows)
        spent = {b: store.spend(b, day_start()) for b in names}
    show_history(rows, as_json, console(), spent)


@app.command()
def stack(
    ctx: typer.Context,
    backend: Annotated[str | None, typer.Option(help="Only this backend.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Every distinct serving stack each backend has shown, and what changed between them."""
    from canaryd.report.console import show_stacks

    with reader_of(load(ctx)) as store:
        stacks = store.stacks(backend)
    show_stacks(stacks, as_json, console())


@app.command()
def init(
    path: Annotated[Path, typer.Argument(help="Where to write the config.")] = Path("canaryd.toml"),
    force: Annotated[bool, typer.Option("--force", help="Overwrite existing files.")] = False,
    url: Annotated[
        str | None, typer.Option("--url", help="Ask the server there which engine it is; write its kind.")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Write a commented example config (and a copy of the default canary suite beside it).

    PATH may be an existing directory: canaryd.toml goes into it. Existing files are never overwritten
    without --force (exit 2). With --url, the block written is the kind of the engine that answers there.
    """
    from canaryd.scaffold import write_example

    found = None
    if url is not None:
        from canaryd.backends.detect import detect

        found = detect(url)
    written = write_example(path, force=force, found=found, url=url)
    if as_json:
        engine = {"engine": found.as_dict()} if found else {}
        emit({"exit_code": EXIT_OK, "written": [str(p) for p in written], **engine})
        return
    if found is not None:
        print(f"found {found.kind} at {url}: {found.evidence}")
    for p in written:
        print(f"wrote {p}")


@app.command()
def demo(
    workdir: Annotated[Path, typer.Option(help="Where the tiny model, config and database go.")] = Path(
        ".canaryd-demo"
    ),
) -> None:
    """Build a tiny model, serve it with vLLM, and show probe → baseline → silent shift → drift verdict."""
    from canaryd.demo import run_demo

    raise typer.Exit(run_demo(workdir, console()))


app.add_typer(baseline.app, name="baseline")
app.add_typer(db.app, name="db")
app.add_typer(ops.app, name="ops")
app.command("report")(report.report)
app.command("doctor")(doctor.doctor)


def _configure_logging(level: str) -> None:
    from canaryd import log as logsetup

    logsetup.configure(level)


def main(argv: list[str] | None = None) -> None:
    from canaryd import lazy
    from canaryd.files import private_umask

    lazy.on_first_log(partial(_configure_logging, "warning"))  # until the options say otherwise

    private_umask()  # what canaryd creates (history, WAL, exports, pins, records) is its owner's alone
    args = hoist_global_options(sys.argv[1:] if argv is None else argv, runs_a_command=("preflight",))
    own = args[: args.index("--") if "--" in args else None]  # canaryd's own, not a benchmark's
    as_json, State.help_asked = "--json" in own, "--help" in own
    try:
        app(args, prog_name="canaryd")  # usage errors exit 2 and typer.Exit(code) exits with code
    except InputError as e:
        _fail(EXIT_USAGE, "canaryd: error", str(e), as_json)
    except BudgetSpent as e:
        _fail(EXIT_UNAVAILABLE, "canaryd: over budget", str(e), as_json)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # the last line of defence: one line, no traceback unless debugging
        sqlalchemy = sys.modules.get("sqlalchemy.exc")  # imported by whatever raised it, if anything did
        if sqlalchemy is not None and isinstance(e, sqlalchemy.SQLAlchemyError):
            _fail(EXIT_INTERNAL, "canaryd: storage error", str(e).splitlines()[0], as_json)
        lazy.Logger("canaryd").debug("internal_error", exc_info=True)
        _fail(EXIT_INTERNAL, "canaryd: internal error", f"{e.__class__.__name__}: {e}", as_json)


def _fail(code: int, prefix: str, message: str, as_json: bool) -> None:
    """One line on stderr (at priority err under journald) and the exit code; under ``--json`` the
    envelope on stdout too."""
    from canaryd.log import to_stderr

    to_stderr(f"{prefix}: {message}", "error")
    if as_json:
        emit({"exit_code": code, "error": message})
    sys.exit(code)
