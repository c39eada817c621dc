"""``canaryd run`` and ``validate``: the daemon (`canaryd.daemon.service`), and the config it would run."""

from __future__ import annotations

import typer

from canaryd.commands import JsonFlag, commands, emit, load
from canaryd.errors import EXIT_OK, InputError

app = commands()


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
    if cfg.daemon.web_config is not None:
        from canaryd.daemon.webconfig import load_web_config

        load_web_config(cfg.daemon.web_config)  # the listener's TLS and users, as `run` will read them
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
