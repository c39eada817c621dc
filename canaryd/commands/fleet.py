"""``canaryd fleet``: the daemons sharing this config's PostgreSQL database, their shares and last passes."""

from __future__ import annotations

import typer

from canaryd.commands import JsonFlag, commands, console, emit, load, reader_of
from canaryd.errors import EXIT_DRIFT, EXIT_OK

app = commands()


@app.command()
def fleet(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """List the live daemons of a fleet on one PostgreSQL database: the backends each holds, its share of
    the weighted work and its last pass (exit 1 when no daemon is live)."""
    from canaryd.store.fleet import fleet as members_of

    cfg = load(ctx)
    with reader_of(cfg) as store:
        if not store.leased:
            if as_json:
                emit({"exit_code": EXIT_OK, "database": store.url, "single_daemon": True, "daemons": []})
            else:
                print(f"{store.url}: SQLite: a single daemon probes every backend (fleets need PostgreSQL)")
            return
        members, leased = members_of(store)
        url = store.url
    live = [m for m in members if m.live]
    code = EXIT_OK if live else EXIT_DRIFT
    if as_json:
        emit(
            {
                "exit_code": code,
                "database": url,
                "single_daemon": False,
                "backends_leased": leased,
                "daemons": [
                    {
                        "instance": m.instance,
                        "holder": m.holder,
                        "live": m.live,
                        "backends": m.backends,
                        "share": round(m.share, 4),
                        "started": m.started.isoformat(),
                        "last_pass": m.last_pass.isoformat(),
                        "last_pass_ago_s": round(m.last_pass_ago_s, 1),
                    }
                    for m in members
                ],
            }
        )
        raise typer.Exit(code)
    from rich.table import Table

    from canaryd.report.tables import print_tables

    t = Table(
        title=f"canaryd fleet: {len(live)} live daemon(s), {leased} backend(s) leased", title_justify="left"
    )
    for col in ("instance", "holder", "live", "backends", "share", "last pass", "started"):
        t.add_column(col, justify="right" if col in ("backends", "share") else "left")
    for m in members:
        t.add_row(
            m.instance,
            m.holder,
            "yes" if m.live else "no",
            str(m.backends),
            f"{100 * m.share:.1f} %",
            f"{m.last_pass:%Y-%m-%d %H:%M:%S} ({m.last_pass_ago_s:.1f} s ago)",
            f"{m.started:%Y-%m-%d %H:%M:%S}",
        )
    print_tables(console(), t)
    raise typer.Exit(code)
