"""``canaryd doctor BACKEND``: ask an endpoint what it accepts and returns, and print (or write) the request
profile that follows (see `canaryd.backends.discover`)."""

from __future__ import annotations

from typing import Annotated

import typer

from canaryd.commands import JsonFlag, commands, console, emit, load
from canaryd.errors import EXIT_OK, EXIT_UNAVAILABLE

app = commands()


@app.command()
def doctor(
    ctx: typer.Context,
    backend: Annotated[str, typer.Argument(help="The backend (its name in the config) to ask.")],
    write: Annotated[
        bool, typer.Option("--write", help="Write the profile into the config file's backend block.")
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """A few tiny requests (8 tokens each, spend printed first) that find what an endpoint accepts and
    returns (token parameter, sampling parameters, logprobs and how many, /completions, fingerprint, reasoning
    tokens); prints the findings and the matching [backends.request] profile. Exit 3 when unreachable."""
    from canaryd.backends import discover as doc
    from canaryd.backends.base import HttpSettings
    from canaryd.backends.profile import insert_profile, to_toml
    from canaryd.log import to_stderr

    cfg = load(ctx)
    settings = cfg.backend(backend)
    bound = doc.estimate(settings.kind)
    # Before anything is sent: on stderr under --json, so that stdout stays one JSON document.
    each = doc.answer_tokens(settings.kind)
    ahead = (
        f"doctor: asking {backend!r} at most {bound['requests']} requests of at most {each} answer "
        f"tokens each: at most {bound['tokens']} tokens"
    )
    if as_json:
        to_stderr(ahead, "info")
    else:
        print(ahead, flush=True)
    engine = doc.engine(settings) if isinstance(settings, HttpSettings) else None
    if engine is not None and not as_json:
        _say_engine(engine, backend, settings.kind)
    try:
        found = doc.discover(settings)
    except doc.Unreachable as e:
        to_stderr(f"canaryd: doctor: {e}", "error")
        if as_json:
            emit({"exit_code": EXIT_UNAVAILABLE, "error": str(e), "estimate": bound})
        raise typer.Exit(EXIT_UNAVAILABLE) from None
    profile = doc.profile(found)
    preset = doc.preset_for(settings.base_url, found)
    block = to_toml(profile, backend, preset)
    if write:
        insert_profile(cfg.path, backend, block, profile)
    spent = {"requests": found.requests, "tokens": found.tokens}
    if as_json:
        emit(
            {
                "exit_code": EXIT_OK,
                "backend": backend,
                "estimate": bound,
                "engine": engine,
                "findings": found.as_dict(),
                "profile": profile,
                "preset": preset,
                "written": str(cfg.path) if write else None,
                "spent": spent,
            }
        )
        return
    _show(found)
    print()
    print(block, end="")
    print()
    if write:
        print(f"wrote [backends.request] of {backend!r} into {cfg.path}")
    print(f"doctor: spent {found.requests} requests, {found.tokens} tokens")


def _say_engine(engine: dict, backend: str, kind: str) -> None:
    """Which engine answers, and the kind that would read its own stack (printed before any request)."""
    if engine["kind"] is None:
        print(f"engine: not told ({engine['evidence']})")
        return
    print(f"engine: {engine['kind']} ({engine['evidence']})")
    if engine["proposed"]:
        print(
            f'  backend {backend!r} is kind = "{kind}"; kind = "{engine["proposed"]}" also reads the '
            "engine's own stack (its launch arguments, weights, build)"
        )


def _show(found) -> None:
    from rich.markup import escape
    from rich.table import Table

    from canaryd.report.tables import print_tables

    logprobs = {
        "returned": f"returned, top {found.top_logprobs}",
        "legacy": f"returned in the legacy tokens/token_logprobs shape, top {found.top_logprobs}",
        "ignored": "not returned (the parameter is ignored)",
        "refused": "refused",
        "untested": "untested",
    }[found.logprobs]
    seed = "refused" if "seed" in found.refused else "accepted"
    rows = [
        ("token limit parameter", found.token_param, "token_param"),
        ("sampling parameters refused", ", ".join(found.refused) or "none", "sampling"),
        ("temperature 0", "refused" if "temperature" in found.refused else "accepted", "temperature"),
        ("seed", f"refused (takes {found.seed_alias})" if found.seed_alias else seed, "seed_alias"),
        ("logprobs", logprobs, "logprobs"),
        ("/completions endpoint", "yes" if found.completions else "no", "completions"),
        ("system_fingerprint", found.fingerprint or "none", "fingerprint"),
        (
            "reasoning tokens",
            "none reported" if found.reasoning_tokens is None else str(found.reasoning_tokens),
            "reasoning",
        ),
    ]
    if found.reasoning_effort is not None:
        rows.append(
            ("reasoning_effort", "accepted" if found.reasoning_effort else "refused", "reasoning_effort")
        )
    if "stopped" in found.evidence:
        rows.append(("(stopped)", "", "stopped"))
    table = Table("question", "finding", "evidence")
    for question, finding, key in rows:  # a provider's message is text, never rich markup
        table.add_row(escape(question), escape(finding), escape(found.evidence.get(key, "")))
    print_tables(console(), table)
