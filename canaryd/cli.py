"""The ``canaryd`` command line.

Exit codes (also in ``canaryd --help`` and the README):

0  every canary identical to its baseline (or a new baseline was recorded)
1  drift: a regression, answer drift, logprob drift or stack change
2  bad config, canary file or command-line usage
3  a backend was unreachable or failing, so it could not be judged
4  internal or storage error (a bug or a broken database: see the log)

``preflight`` exits 1 or 3 as ``check --pin`` would, without running its command; once the canaries pass,
it exits with the command's own exit code.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from importlib.metadata import version as dist_version
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import structlog
import typer
from rich.console import Console
from sqlalchemy.exc import SQLAlchemyError

from canaryd import log as logsetup
from canaryd.canaries import load_suites
from canaryd.config import Config, find_config, load_config, parse_duration
from canaryd.errors import InputError
from canaryd.judge.compare import Verdict
from canaryd.probe.run import Result
from canaryd.report.pin import Pin, PinReport, check_pin, load_pin
from canaryd.stack import diff, merge_stacks

if TYPE_CHECKING:
    from canaryd.store import Store

EXIT_OK, EXIT_DRIFT, EXIT_USAGE, EXIT_UNAVAILABLE, EXIT_INTERNAL = 0, 1, 2, 3, 4

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
        print(f"canaryd {dist_version('canaryd')} (python {sys.version.split()[0]})")
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


def gate(results: list[Result]) -> int:
    """The exit code of a probe pass: unreachable beats drift beats identical."""
    if any(r.comparison.verdict is Verdict.ERROR for r in results):
        return EXIT_UNAVAILABLE
    if any(r.comparison.verdict.is_drift for r in results):
        return EXIT_DRIFT
    return EXIT_OK


@contextmanager
def _store(cfg: Config) -> Iterator[Store]:
    from canaryd.store import Store

    store = Store(cfg.storage_url, instance=cfg.daemon.instance)
    try:
        yield store
    finally:
        store.close()


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _stacks_now(results: list[Result]) -> dict[str, dict[str, str]]:
    """Each probed backend's stack in this pass ({} when no canary got through)."""
    names = dict.fromkeys(r.observation.backend for r in results)
    return {
        b: merge_stacks(
            r.observation.stack for r in results if r.observation.backend == b and r.observation.ok
        )
        for b in names
    }


def _pinned_config(cfg: Config, pin: Pin, pin_path: Path, backend: str | None) -> Config:
    """The config narrowed to the pinned backends: a check against a pin probes what the pin names."""
    names = {b.name for b in cfg.backends}
    for name in pin.backends:
        if name not in names:
            raise InputError(f"{pin_path}: backend {name!r} is not in {cfg.path}")
    if backend is not None and backend not in pin.backends:
        raise InputError(f"{pin_path}: backend {backend!r} is not pinned (pinned: {', '.join(pin.backends)})")
    return cfg.model_copy(update={"backends": tuple(b for b in cfg.backends if b.name in pin.backends)})


def _pin_table(report: PinReport):
    from rich.table import Table

    t = Table(title="pin", title_justify="left")
    for col in ("backend", "field", "pinned", "now", "status"):
        t.add_column(col, overflow="fold")
    for f in report.fields:
        status = "new (not failing)" if not f.moved else ("gone" if f.now is None else "moved")
        t.add_row(f.backend, f.field, f.pinned or "(absent)", f.now or "(absent)", status)
    for b in report.unreachable:
        t.add_row(b, "-", "-", "-", "unreachable")
    return t


def _show(results: list[Result], pin: PinReport | None, as_json: bool, console: Console) -> int:
    """Print a pass (and its pin check) as tables or JSON; return the gate's exit code."""
    from canaryd.report.tables import print_tables, result_dict, results_table, stack_changes_table

    code = gate(results)
    if code == EXIT_OK and pin is not None and not pin.matches:
        code = EXIT_DRIFT
    if as_json:
        doc = {"exit_code": code, "results": [result_dict(r) for r in results]}
        if pin is not None:
            doc["pin"] = pin.as_dict()
        print(json.dumps(doc, indent=2))
        return code
    print_tables(console, results_table(results), stack_changes_table(results))
    if pin is not None:
        if pin.fields or pin.unreachable:
            console.print(_pin_table(pin))
        verdict = "matches" if pin.matches else f"{len(pin.moved)} field(s) moved"
        if pin.unreachable:
            verdict = f"cannot be confirmed ({', '.join(pin.unreachable)} unreachable)"
        console.print(f"pin {pin.path}: {verdict}", highlight=False, soft_wrap=True)
    for r in results:
        if r.comparison.verdict is Verdict.ERROR:
            print(
                f"canaryd: backend {r.observation.backend!r} canary {r.observation.canary_id!r}: "
                f"{r.observation.error}",
                file=sys.stderr,
            )
            break
    return code


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
    from canaryd.probe.run import run_pass

    if pin is None:
        raise typer.Exit(_show(run_pass(_config(ctx), only=backend), None, as_json, out))
    pinned = load_pin(pin)
    results = run_pass(_pinned_config(_config(ctx), pinned, pin, backend), only=backend)
    raise typer.Exit(_show(results, check_pin(pinned, _stacks_now(results), str(pin)), as_json, out))


@app.command()
def probe(
    ctx: typer.Context,
    backend: Annotated[str | None, typer.Option(help="Only this backend.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")] = False,
) -> None:
    """Send every canary through every backend and record the observations (exit 3 if one was down)."""
    from canaryd.probe.run import run_pass

    code = _show(run_pass(_config(ctx), only=backend), None, as_json, out)
    raise typer.Exit(EXIT_UNAVAILABLE if code == EXIT_UNAVAILABLE else EXIT_OK)


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
    import time

    from canaryd.backends import BackendUnavailable, make_backend
    from canaryd.probe.census import census_table, fillers_for, parse_batch_sizes, run_census
    from canaryd.probe.run import plan
    from canaryd.stack import stack_hash

    sizes = parse_batch_sizes(batch_sizes)
    if not 1 <= requests <= 100_000:
        raise InputError(f"--requests: {requests} is not from 1 to 100000")
    cfg = _config(ctx)
    if backend is not None:
        cfg.backend(backend)  # an unknown name is an InputError
    planned = plan(cfg, load_suites([s.path for s in cfg.suites]), only=backend)
    # one request per probe: a chained canary's steps depend on each other's outputs, so it is left out
    work = {b: [c for c in cs if c.steps is None] for b, cs in planned.items()}
    chained = {c.id for cs in planned.values() for c in cs if c.steps is not None}
    known = {c.id for cs in work.values() for c in cs}
    for cid in canary or ():
        if cid in chained:
            raise InputError(f"--canary: {cid!r} is a chained canary; the census takes single-request ones")
        if cid not in known:
            raise InputError(f"--canary: unknown canary {cid!r} (not in the suites of the chosen backends)")
    censuses, entries, stacks, unavailable = [], [], {}, {}
    for name, canaries in work.items():
        chosen = [c for c in canaries if not canary or c.id in canary]
        if not chosen:
            continue
        # the census puts max(sizes) requests in flight at once, beyond the backend's usual concurrency
        bcfg = cfg.backend(name)
        b = make_backend(bcfg.model_copy(update={"concurrency": max(bcfg.concurrency, *sizes)}))
        try:
            stacks[name] = stack_hash(b.snapshot())
            for c in chosen:
                t0 = time.monotonic()
                result = run_census(b, c, n=requests, batch_sizes=sizes, fillers=fillers_for(c, canaries))
                censuses.append(result)
                entries.append({**result.as_dict(), "wall_s": round(time.monotonic() - t0, 3)})
        except BackendUnavailable as e:
            unavailable[name] = str(e)
            print(f"canaryd: census: backend {name!r} unreachable: {e}", file=sys.stderr)
        finally:
            b.close()
    incomplete = [c for c in censuses if not c.complete]
    for c in incomplete:
        print(f"canaryd: census: {c.backend} {c.canary}: every probe of a batch size failed", file=sys.stderr)
    code = EXIT_OK
    if unavailable or incomplete:
        code = EXIT_UNAVAILABLE
    elif strict and any(False in (c.deterministic, c.batch_invariant) for c in censuses):
        code = EXIT_DRIFT
    doc = {
        "exit_code": code,
        "requests": requests,
        "batch_sizes": list(sizes),
        "stacks": stacks,
        "unavailable": unavailable,
        "censuses": entries,
    }
    if output is not None:
        output.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    if as_json:
        print(json.dumps(doc, indent=2, ensure_ascii=False))
    else:
        if censuses:
            out.print(census_table(censuses))
        for c in censuses:
            out.print(f"{c.backend} {c.canary}: {c.verdict()}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@app.command("pin")
def pin_cmd(
    ctx: typer.Context,
    backend: Annotated[str | None, typer.Option(help="Only this backend.")] = None,
    out_file: Annotated[Path | None, typer.Option("--out", help="Write here (default: stdout).")] = None,
) -> None:
    """Probe once and write each backend's stack as it is now: a lock file for `check --pin`/`preflight`."""
    from canaryd.probe.run import run_pass
    from canaryd.report.pin import PinnedBackend, to_json

    cfg = _config(ctx)
    results = run_pass(cfg, only=backend)
    if gate(results) == EXIT_UNAVAILABLE:
        bad = next(r.observation for r in results if r.comparison.verdict is Verdict.ERROR)
        print(f"canaryd: pin: backend {bad.backend!r} failed ({bad.error}): nothing pinned", file=sys.stderr)
        raise typer.Exit(EXIT_UNAVAILABLE)
    runs = {r.observation.backend: r.run_id for r in results}
    pinned = Pin(
        created=_now(),
        canaryd=dist_version("canaryd"),
        backends={b: PinnedBackend(cfg.backend(b).kind, s, runs[b]) for b, s in _stacks_now(results).items()},
    )
    with _store(cfg) as store:
        store.keep([r.observation_id for r in results], "pin")
    drifted = sum(r.comparison.verdict.is_drift for r in results)
    if drifted:
        print(f"canaryd: pin: note: {drifted} canaries drifted from their baselines", file=sys.stderr)
    if out_file is None:
        sys.stdout.write(to_json(pinned))
        return
    out_file.write_text(to_json(pinned), encoding="utf-8")
    for name, b in pinned.backends.items():
        print(f"{out_file}: pinned {name} ({b.kind}): {len(b.fields)} fields, run {b.run_id}")


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
    from canaryd.probe.run import run_pass
    from canaryd.report.record import build_record, summarize, to_markdown

    pinned = load_pin(pin)
    cfg = _pinned_config(_config(ctx), pinned, pin, backend)
    err = Console(stderr=True, soft_wrap=False, width=160)
    results = run_pass(cfg, only=backend)
    code = _show(results, check_pin(pinned, _stacks_now(results), str(pin)), False, err)
    if code != EXIT_OK:
        why = (
            "a backend was unreachable or failing"
            if code == EXIT_UNAVAILABLE
            else "the stack or the canaries moved"
        )
        print(f"canaryd: preflight: {why} (see above): not starting {command[0]!r}", file=sys.stderr)
        raise typer.Exit(code)
    with _store(cfg) as store:
        store.keep([r.observation_id for r in results], "preflight")
    started = _now()
    try:
        returncode = subprocess.run(command, check=False).returncode
    except OSError as e:
        print(f"canaryd: preflight: cannot start {command[0]!r}: {e.strerror or e}", file=sys.stderr)
        raise typer.Exit(127) from None
    finished = _now()
    after = run_pass(cfg, only=backend) if post_check else []
    with _store(cfg) as store:
        store.keep([r.observation_id for r in after], "preflight")
        version = dist_version("canaryd")
        rec = build_record(
            store, sorted({r.run_id for r in results}), pin=pinned, pin_path=str(pin), version=version
        )
        rec["command"] = {
            "argv": command,
            "cwd": str(Path.cwd()),
            "started": started,
            "finished": finished,
            "exit_code": returncode,
        }
        if after:
            post = build_record(store, sorted({r.run_id for r in after}), pin=pinned, pin_path=str(pin))
            rec["post_run"] = summarize(post)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "canaryd-record.json").write_text(json.dumps(rec, indent=2, ensure_ascii=False) + "\n")
    (out_dir / "canaryd-record.md").write_text(to_markdown(rec), encoding="utf-8")
    if after and not rec["post_run"]["held"]:
        print(
            "canaryd: preflight: warning: the stack or canaries moved while the command ran", file=sys.stderr
        )
    print(f"canaryd: preflight: record in {out_dir / 'canaryd-record.md'} (and .json)", file=sys.stderr)
    raise typer.Exit(returncode if returncode >= 0 else 128 - returncode)


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
    from canaryd.report.record import explain as explain_flips
    from canaryd.report.record import explain_text

    with _store(_config(ctx)) as store:
        doc = explain_flips(store, backend, canary)
    if as_json:
        print(json.dumps(doc, indent=2, ensure_ascii=False))
    else:
        sys.stdout.write(explain_text(doc))


def _since(value: str) -> datetime:
    """An ISO 8601 time (naive means UTC) or a duration back from now (2h, 30m, 7d)."""
    try:
        return datetime.now(UTC) - timedelta(seconds=parse_duration(value))
    except ValueError:
        pass
    try:
        t = datetime.fromisoformat(value)
    except ValueError:
        raise InputError(f"--since: {value!r} is neither an ISO 8601 time nor a duration (e.g. 2h)") from None
    return (t if t.tzinfo else t.replace(tzinfo=UTC)).astimezone(UTC)


def _write(text: str, path: Path | None) -> None:
    if path is None:
        sys.stdout.write(text)
    else:
        path.write_text(text, encoding="utf-8")


@app.command("record")
def record_cmd(
    ctx: typer.Context,
    run: Annotated[list[int] | None, typer.Option("--run", help="A run id (repeatable).")] = None,
    since: Annotated[str | None, typer.Option(help="Every run since: ISO 8601 time or duration.")] = None,
    pin: Annotated[Path | None, typer.Option(help="Say whether the session matched this pin.")] = None,
    fmt: Annotated[str, typer.Option("--format", help="md or json.")] = "md",
    out_file: Annotated[Path | None, typer.Option("--out", help="Write here (default: stdout).")] = None,
) -> None:
    """The reproducibility record of a session, from the store: stack, pin, canaries, changes, pointers."""
    from canaryd.report.record import build_record, to_markdown

    if (not run) == (since is None):
        raise InputError("record: give either --run ID (repeatable) or --since TIME")
    if fmt not in ("md", "json"):
        raise InputError(f"--format: {fmt!r} is not md or json")
    pinned = load_pin(pin) if pin is not None else None
    with _store(_config(ctx)) as store:
        run_ids = run or store.run_ids(_since(since))  # type: ignore[arg-type]
        if not run_ids:
            raise InputError(f"record: no runs since {since}")
        rec = build_record(
            store, run_ids, pin=pinned, pin_path=str(pin or ""), version=dist_version("canaryd")
        )
        store.keep(rec["storage"]["observation_ids"], "record")
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
    try:
        cutoff = datetime.now(UTC) - timedelta(seconds=parse_duration(older_than))
    except ValueError as e:
        raise InputError(f"--older-than: {e}") from None
    with _store(_config(ctx)) as store:
        counts = store.prune(cutoff, dry_run=dry_run)
    rest = ", ".join(f"{n} {table}" for table, n in counts.items() if table != "observation")
    verb = "would delete" if dry_run else "deleted"
    print(
        f"{verb} {counts['observation']} observations started before {cutoff:%Y-%m-%dT%H:%M:%SZ}; then {rest}"
    )


@app.command()
def export(
    ctx: typer.Context,
    run: Annotated[list[int], typer.Option("--run", help="A run id (repeatable).")],
    out_file: Annotated[Path | None, typer.Option("--out", help="Write here (default: stdout).")] = None,
) -> None:
    """A run's raw observations as JSON lines: every field, tokens, logprobs, top-k and the stack."""
    from canaryd.report.record import export_line

    with _store(_config(ctx)) as store:
        pairs = store.load(store.ids_of_runs(run))
    if not pairs:
        raise InputError(f"export: no observations in run(s) {', '.join(map(str, run))}")
    _write("".join(json.dumps(export_line(r, o), ensure_ascii=False) + "\n" for r, o in pairs), out_file)


@app.command()
def run(ctx: typer.Context) -> None:
    """Run the daemon: probe on the configured schedules and serve Prometheus metrics."""
    from canaryd.daemon.service import Daemon

    path = find_config(ctx.obj.config_path)
    if ctx.obj.log_level is None:
        logsetup.configure("info")  # a daemon logs its observations unless told otherwise
    Daemon(path, load_config(path)).serve_forever()


@app.command()
def validate(ctx: typer.Context) -> None:
    """Check the config and every canary file without probing anything."""
    cfg = _config(ctx)
    suites = load_suites([s.path for s in cfg.suites])
    n = sum(len(s.canaries) for s in suites)
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
) -> None:
    """Diff runs answer by answer and step by step: changes, flips, scores per suite, fingerprints, stacks.

    Exit 0 when no answer or step changed in any pair, 1 when one did (like diff(1)).
    """
    from canaryd.report.rundiff import (
        Run,
        changed_lines,
        diff_runs,
        diff_table,
        pairs_of,
        scores_table,
        step_output,
    )
    from canaryd.report.tables import print_tables

    if len(runs) % 2:
        raise InputError(f"diff: run ids come in pairs (A B [C D ...]), got {len(runs)}")
    if label and len(label) != len(runs) // 2:
        raise InputError(f"--label: {len(label)} label(s) for {len(runs) // 2} pair(s) of runs")
    loaded: dict[int, Run] = {}
    with _store(_config(ctx)) as store:
        for rid in dict.fromkeys(runs):
            row = store.run(rid)
            if row is None:
                raise InputError(f"diff: no run {rid} in {store.url}")
            stored = store.load(store.ids_of_runs([rid]))
            loaded[rid] = Run(rid, row.backend, row.started_at, tuple(step_output(r, o) for r, o in stored))
    diffs = [
        diff_runs(loaded[a], loaded[b], label[i] if label else "") for i, (a, b) in enumerate(pairs_of(runs))
    ]
    code = EXIT_DRIFT if any(d.changed for d in diffs) else EXIT_OK
    if as_json:
        doc = {"exit_code": code, "pairs": [d.as_dict() for d in diffs]}
        print(json.dumps(doc, indent=2, ensure_ascii=False))
    else:
        print_tables(out, diff_table(diffs), scores_table(diffs))
        for line in changed_lines(diffs):
            out.print(line, highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@app.command()
def history(
    ctx: typer.Context,
    backend: Annotated[str | None, typer.Option(help="Only this backend.")] = None,
    canary: Annotated[str | None, typer.Option(help="Only this canary.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=100000)] = 50,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Stored observations, newest first."""
    from canaryd.report.tables import history_table
    from canaryd.store import Store

    store = Store(_config(ctx).storage_url)
    rows = store.observations(backend=backend, canary_id=canary, limit=limit)
    store.close()
    if as_json:
        print(json.dumps([r.model_dump(mode="json") for r in rows], indent=2))
    else:
        out.print(history_table(rows))


@app.command()
def stack(
    ctx: typer.Context,
    backend: Annotated[str | None, typer.Option(help="Only this backend.")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Every distinct serving stack each backend has shown, and what changed between them."""
    from canaryd.store import Store

    store = Store(_config(ctx).storage_url)
    stacks = store.stacks(backend)
    store.close()
    if as_json:
        print(
            json.dumps(
                [
                    {"backend": b, "hash": h, "first_seen": t.isoformat(), "fields": f}
                    for b, h, t, f in stacks
                ],
                indent=2,
            )
        )
        return
    previous: dict[str, dict] = {}
    for b, h, t, fields in stacks:
        out.print(f"[bold]{b}[/] stack [cyan]{h}[/] first seen {t:%Y-%m-%d %H:%M:%S} UTC")
        if b not in previous:
            for k in sorted(fields):
                out.print(f"  {k} = {fields[k]}", highlight=False)
        else:
            for c in diff(previous[b], fields):
                out.print(f"  {c.field}: {c.before} -> {c.after}", highlight=False)
        previous[b] = fields


@baseline_app.command("accept")
def baseline_accept(
    ctx: typer.Context,
    backend: Annotated[str | None, typer.Option(help="Only this backend.")] = None,
    canary: Annotated[
        str | None, typer.Option(help="Only this canary (a chained one: all its steps).")
    ] = None,
) -> None:
    """Make the latest successful observation the baseline (after an intended change)."""
    from canaryd.store import Store

    cfg = _config(ctx)
    if backend is not None:
        cfg.backend(backend)
    store = Store(cfg.storage_url)
    accepted = store.accept_latest(backend, canary)
    # a noise model measured on the old stack would call the new one "out" forever
    dropped = store.drop_calibrations([(b, c) for b, c, _ in accepted])
    store.close()
    for b, c, obs_id in accepted:
        print(f"{b} {c}: baseline is now observation {obs_id}")
    if dropped:
        print(f"{dropped} calibration(s) dropped with the old baselines: run `canaryd baseline calibrate`")
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
    from canaryd.backends import BackendUnavailable, make_backend
    from canaryd.probe.calibrate import calibrate
    from canaryd.probe.census import parse_batch_sizes
    from canaryd.probe.run import plan
    from canaryd.report.tables import calibration_table

    cfg = _config(ctx)
    if backend is not None:
        cfg.backend(backend)
    sizes = parse_batch_sizes(batch_sizes) if batch_sizes is not None else cfg.compare.calibration_batch_sizes
    k = cfg.compare.calibration_k if k is None else k
    if not 2 <= k <= 1000:
        raise InputError(f"-k: {k} is not from 2 to 1000")
    work = plan(cfg, load_suites([s.path for s in cfg.suites]), only=backend)
    known = {c.id: c for cs in work.values() for c in cs}
    for cid in canary or ():
        if cid not in known:
            raise InputError(f"--canary: unknown canary {cid!r} (not in the suites of the chosen backends)")
        if known[cid].decoding.samples > 1:
            raise InputError(
                f"--canary: {cid!r} is a sampled canary; its two-sample test needs no calibration"
            )
    results, code = [], EXIT_OK
    with _store(cfg) as store:
        for name, canaries in work.items():
            chosen = [c for c in canaries if not canary or c.id in canary]
            bcfg = cfg.backend(name)
            b = make_backend(bcfg.model_copy(update={"concurrency": max(bcfg.concurrency, *sizes)}))
            try:
                b.snapshot()
                results.extend(calibrate(b, chosen, store, k=k, batch_sizes=sizes, others=canaries))
            except BackendUnavailable as e:
                print(f"canaryd: baseline calibrate: backend {name!r} unreachable: {e}", file=sys.stderr)
                code = EXIT_UNAVAILABLE
            finally:
                b.close()
    if any(r.unavailable for r in results):
        code = EXIT_UNAVAILABLE
    elif code == EXIT_OK and any(r.problem for r in results):
        code = EXIT_DRIFT
    if as_json:
        print(json.dumps({"exit_code": code, "calibrations": [r.as_dict() for r in results]}, indent=2))
    else:
        out.print(calibration_table(results))
        for r in results:
            if r.problem:
                print(f"canaryd: backend {r.backend!r} canary {r.canary_id!r}: {r.problem}", file=sys.stderr)
    raise typer.Exit(code)


db_app = typer.Typer(help="The history database's schema (Alembic migrations).", no_args_is_help=True)
app.add_typer(db_app, name="db")


@db_app.command("upgrade")
def db_upgrade(ctx: typer.Context) -> None:
    """Migrate the database to this canaryd's schema (every command and the daemon also do it at start)."""
    from canaryd.store import make_engine, migrate

    engine = make_engine(_config(ctx).storage_url)
    try:
        before, after = migrate(engine)
        where = engine.url.render_as_string(hide_password=True)
    finally:
        engine.dispose()
    if before is None:
        print(f"{where}: created the schema at revision {after} (head)")
    elif before == after:
        print(f"{where}: at revision {after} (head): nothing to do")
    else:
        print(f"{where}: upgraded from revision {before} to {after} (head)")


@db_app.command("current")
def db_current(
    ctx: typer.Context,
    check: Annotated[bool, typer.Option("--check", help="Exit 1 unless the database is at head.")] = False,
) -> None:
    """Print the database's schema revision (changes nothing)."""
    from canaryd.store import SCHEMA_REVISION, current_revision, known_revisions, make_engine

    engine = make_engine(_config(ctx).storage_url)
    try:
        rev = current_revision(engine)
    finally:
        engine.dispose()
    if rev == SCHEMA_REVISION:
        print(f"{rev} (head)")
    elif rev is None:
        print(f"none: an empty database (head is {SCHEMA_REVISION}; run `canaryd db upgrade`)")
    elif rev not in known_revisions():
        print(f"{rev}: newer than this canaryd (head {SCHEMA_REVISION}): upgrade canaryd")
    else:
        print(f"{rev} (head is {SCHEMA_REVISION}; run `canaryd db upgrade`)")
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
    log = structlog.get_logger("canaryd")
    try:
        app()  # usage errors exit 2 and typer.Exit(code) exits with code, as SystemExit
    except InputError as e:
        print(f"canaryd: error: {e}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    except SQLAlchemyError as e:
        print(f"canaryd: storage error: {str(e).splitlines()[0]}", file=sys.stderr)
        sys.exit(EXIT_INTERNAL)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # the last line of defence: one line, no traceback unless debugging
        log.debug("internal_error", exc_info=True)
        print(f"canaryd: internal error: {e.__class__.__name__}: {e}", file=sys.stderr)
        sys.exit(EXIT_INTERNAL)
