"""``canaryd init`` and ``demo``: a first config (`canaryd.scaffold`), and the tour (`canaryd.demo`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from canaryd.commands import JsonFlag, commands, console, emit
from canaryd.errors import EXIT_OK

app = commands()


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
