"""``canaryd baseline``: accept the latest observations as baselines, calibrate the noise around them."""

from __future__ import annotations

from typing import Annotated

import typer

from canaryd.commands import JsonFlag, WholeHelpGroup, console, load, show_progress, store_of
from canaryd.errors import InputError

app = typer.Typer(
    name="baseline", help="Manage baselines.", no_args_is_help=True, rich_markup_mode=None, cls=WholeHelpGroup
)


@app.command("accept")
def accept(
    ctx: typer.Context,
    backend: Annotated[str | None, typer.Option(help="Only this backend.")] = None,
    canary: Annotated[
        str | None, typer.Option(help="Only this canary (a chained one: all its steps).")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Make the latest successful observation the baseline (after an intended change)."""
    from canaryd.report.console import show_accepted

    cfg = load(ctx)
    if backend is not None:
        cfg.backend(backend)
    with store_of(cfg) as store:
        accepted = store.accept_latest(backend, canary)
        # a noise model measured on the old stack would call the new one "out" forever
        dropped = store.drop_calibrations([(a.backend, a.canary_id, a.configuration) for a in accepted])
    show_accepted(accepted, dropped, as_json)
    if not accepted:
        raise InputError("baseline accept: no successful observation matches; run `canaryd probe` first")


@app.command("calibrate")
def calibrate(
    ctx: typer.Context,
    backend: Annotated[str | None, typer.Option(help="Only this backend.")] = None,
    canary: Annotated[
        list[str] | None,
        typer.Option("--canary", metavar="ID", help="A canary id (repeatable; default: all)."),
    ] = None,
    k: Annotated[
        int | None, typer.Option("-k", help="Probes per canary (default: calibration_k in [compare]).")
    ] = None,
    batch_sizes: Annotated[
        str | None,
        typer.Option(help="Load levels, e.g. 1,8 (default: calibration_batch_sizes in [compare])."),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Learn each canary's honest noise (K probes, alone and in crowded batches); exit 1 if a baseline
    lies outside it."""
    from canaryd.progress import shown

    with shown("calibrating", "canaries", enabled=show_progress(as_json)):  # before the heavy imports
        from canaryd.probe.calibrate import calibrate_config
        from canaryd.probe.census import parse_batch_sizes

        cfg = load(ctx)
        if backend is not None:
            cfg.backend(backend)  # an unknown name is an InputError, before a bad --batch-sizes
        sizes = parse_batch_sizes(batch_sizes) if batch_sizes is not None else None
        report = calibrate_config(cfg, backend=backend, canary_ids=canary, k=k, batch_sizes=sizes)
    from canaryd.report.console import show_calibration

    show_calibration(report, as_json, console())
    raise typer.Exit(report.exit_code)
