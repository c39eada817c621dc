"""``canaryd check``, ``probe``, ``census``, ``pin`` and ``preflight``: the commands that probe, and the gates
around a pass (`canaryd.probe.preflight`, `canaryd.probe.census`)."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Annotated

import typer

from canaryd.commands import JsonFlag, commands, console, load, show_progress
from canaryd.errors import EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE, InputError

app = commands()
MaxConfigurations = Annotated[
    int | None,
    typer.Option(
        metavar="N",
        help="Also fail (exit 1) when a backend was served by more than N serving configurations.",
    ),
]


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
    from canaryd.api import Canaryd
    from canaryd.progress import shown

    checker = Canaryd(load(ctx))
    with shown("probing", "canaries", enabled=show_progress(as_json)):
        passed = checker.check(backend, pin=pin, max_configurations=max_configurations).passed
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
