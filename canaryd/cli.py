"""The ``canaryd`` command line.

Exit codes (also in ``canaryd --help`` and the README):

0  every canary identical to its baseline (or a new baseline was recorded)
1  drift: a regression, answer drift, logprob drift or stack change
2  bad config, canary file or command-line usage
3  a backend was unreachable or failing, so it could not be judged
4  internal or storage error (a bug or a broken database: see the log)
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import version as dist_version
from pathlib import Path
from typing import Annotated

import structlog
import typer
from rich.console import Console
from sqlalchemy.exc import SQLAlchemyError

from canaryd import log as logsetup
from canaryd.canaries import load_suites
from canaryd.compare import Verdict
from canaryd.config import Config, find_config, load_config
from canaryd.errors import InputError
from canaryd.probe import Result
from canaryd.stack import diff

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


def _probe(ctx: typer.Context, backend: str | None, as_json: bool) -> list[Result]:
    from canaryd.probe import run_pass
    from canaryd.report import print_tables, result_dict, results_table, stack_changes_table

    results = run_pass(_config(ctx), only=backend)
    if as_json:
        print(
            json.dumps({"exit_code": gate(results), "results": [result_dict(r) for r in results]}, indent=2)
        )
    else:
        print_tables(out, results_table(results), stack_changes_table(results))
        for r in results:
            if r.comparison.verdict is Verdict.ERROR:
                print(
                    f"canaryd: backend {r.observation.backend!r} canary {r.observation.canary_id!r}: "
                    f"{r.observation.error}",
                    file=sys.stderr,
                )
                break
    return results


@app.command()
def check(
    ctx: typer.Context,
    backend: Annotated[str | None, typer.Option(help="Only this backend.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")] = False,
) -> None:
    """Probe, compare with the baselines, and exit 0/1/3 (the gate for CI and benchmark sessions)."""
    raise typer.Exit(gate(_probe(ctx, backend, as_json)))


@app.command()
def probe(
    ctx: typer.Context,
    backend: Annotated[str | None, typer.Option(help="Only this backend.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")] = False,
) -> None:
    """Send every canary through every backend and record the observations (exit 3 if one was down)."""
    results = _probe(ctx, backend, as_json)
    raise typer.Exit(EXIT_UNAVAILABLE if gate(results) == EXIT_UNAVAILABLE else EXIT_OK)


@app.command()
def run(ctx: typer.Context) -> None:
    """Run the daemon: probe on the configured schedules and serve Prometheus metrics."""
    from canaryd.daemon import Daemon

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


@app.command()
def history(
    ctx: typer.Context,
    backend: Annotated[str | None, typer.Option(help="Only this backend.")] = None,
    canary: Annotated[str | None, typer.Option(help="Only this canary.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=100000)] = 50,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Stored observations, newest first."""
    from canaryd.report import history_table
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
    canary: Annotated[str | None, typer.Option(help="Only this canary.")] = None,
) -> None:
    """Make the latest successful observation the baseline (after an intended change)."""
    from canaryd.store import Store

    cfg = _config(ctx)
    if backend is not None:
        cfg.backend(backend)
    store = Store(cfg.storage_url)
    accepted = store.accept_latest(backend, canary)
    store.close()
    for b, c, obs_id in accepted:
        print(f"{b} {c}: baseline is now observation {obs_id}")
    if not accepted:
        raise InputError("baseline accept: no successful observation matches; run `canaryd probe` first")


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
