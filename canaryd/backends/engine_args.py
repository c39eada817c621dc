"""A local vLLM server's launch arguments and environment, read from ``/proc``, as ``engine.*``/``env.*``.

No endpoint of vLLM's says how it was started: ``--dtype``, ``--quantization``, ``--enforce-eager``,
``--kv-cache-dtype`` only show through their consequences (cache sizes on ``/metrics``, moved logprobs).
When canaryd runs on the serving host it can read them at the source: the process listening on the
backend's port (``/proc/net/tcp{,6}`` gives the socket's inode, ``/proc/*/fd`` the process holding it; it
works as root or as the server's user), its ``/proc/PID/cmdline`` and ``/proc/PID/environ``.

The fields are the arguments *as given*: a vLLM default is an absent field (``vllm.version`` tells when
the defaults could have moved). Secrets never leave this module: the value of ``--api-key`` and of any
argument whose name looks like a credential (`hostfacts.is_secret_name`) becomes ``<redacted>`` (the
flag being set is configuration, its value is not), secret-named keys inside JSON values likewise, and
secret-named environment variables are dropped, as `hostfacts.env_facts` does for the host. Arguments that
say where the server listens or how it logs (``--host``, ``--port``, ``--uvicorn-log-level`` …) change
nothing the canaries measure and are left out, so moving a port or raising log verbosity is no drift.

Everything here is stdlib and never raises: a process that cannot be found or read is one
``engine.error`` field (and no ``env.*``), never an unchanged-looking stack.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

from canaryd.backends.hostfacts import env_facts, is_secret_name, redact_url

REDACTED = "<redacted>"
# vLLM's short options (vllm/engine/arg_utils.py, 0.32) and the long names they stand for.
_SHORT = {
    "-q": "quantization",
    "-tp": "tensor_parallel_size",
    "-pp": "pipeline_parallel_size",
    "-dp": "data_parallel_size",
    "-dcp": "decode_context_parallel_size",
    "-pcp": "prefill_context_parallel_size",
    "-dpl": "data_parallel_size_local",
    "-dpb": "data_parallel_backend",
    "-ep": "enable_expert_parallel",
    "-sc": "speculative_config",
    "-O": "optimization_level",
}
# Where the server listens, how it logs and which node/rank a process is: not what the canaries measure.
_VOLATILE = re.compile(
    r"^(host|port|uds|headless|root_path|uvicorn_log_level|disable_uvicorn_access_log"
    r"|(disable|enable)_log_\w+|log_\w+|max_log_len|ssl_\w+|enable_ssl_refresh"
    r"|data_parallel_(rank|start_rank|address|rpc_port)|node_rank|api_server_count)$"
)
_NUMBER = re.compile(r"^-\d")
_TCP_LISTEN = "0A"


def vllm_args(argv: list[str]) -> list[str] | None:
    """The arguments vLLM parses, from a full command line; None when it does not start a vLLM server.

    Recognised: ``vllm serve ...`` (any path to the script, or ``python .../vllm serve``),
    ``python -m vllm.entrypoints.openai.api_server ...`` and ``python -m vllm.entrypoints.cli.main serve``.
    For ``serve`` a leading positional is the model, returned as ``--model M``."""
    rest: list[str] | None = None
    for i, tok in enumerate(argv):
        if tok == "-m" and i + 1 < len(argv) and argv[i + 1].startswith("vllm."):
            rest = argv[i + 2 :]
            break
        if os.path.basename(tok) == "vllm" and argv[i + 1 : i + 2] == ["serve"]:
            rest = argv[i + 1 :]
            break
    if rest is None:
        return None
    if rest[:1] == ["serve"]:
        rest = rest[1:]
        if rest and not rest[0].startswith("-"):
            rest = ["--model", rest[0], *rest[1:]]
    return rest


def parse_args(args: list[str]) -> dict[str, str]:
    """vLLM's arguments as ``{name: value}`` (names with underscores): ``--x y`` and ``--x=y`` give
    ``y``, a flag without a value ``"true"``, ``--no-x`` ``x: "false"``, several values are joined with a
    space; a repeated argument keeps its last value, as argparse does. Dotted names (``--compilation-config.
    level 3``) are kept dotted."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        tok = args[i]
        i += 1
        if tok.startswith("-O") and len(tok) > 2:  # -O3, -O=3
            out["optimization_level"] = tok[2:].removeprefix("=")
            continue
        if tok.startswith("--"):
            name, eq, value = tok[2:].partition("=")
        elif tok in _SHORT:
            name, eq, value = _SHORT[tok], "", ""
        else:
            continue  # a stray positional
        name = name.replace("-", "_")
        if not eq:
            values = []
            while i < len(args) and (not args[i].startswith("-") or _NUMBER.match(args[i])):
                values.append(args[i])
                i += 1
            if not values and name.startswith("no_"):
                name, value = name[3:], "false"
            else:
                value = " ".join(values) if values else "true"
        out[name] = value
    return out


def _scrub(value: object) -> object:
    """A JSON value with every secret-named key's value redacted (credentials in --kv-transfer-config …)."""
    if isinstance(value, dict):
        return {k: REDACTED if is_secret_name(str(k)) else _scrub(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrub(v) for v in value]
    return value


def engine_fields(args: dict[str, str]) -> dict[str, str]:
    """``engine.<name>`` for every argument but the volatile ones, secrets redacted; a JSON object value is
    re-serialised with sorted keys (the same config written in another order is the same config)."""
    given = [v for k, v in args.items() if is_secret_name(k) and v not in ("true", "false")]
    secrets = sorted({p for v in given for p in (v, *v.split()) if len(p) >= 4}, key=len, reverse=True)
    out: dict[str, str] = {}
    for name, value in sorted(args.items()):
        if _VOLATILE.match(name):
            continue
        if is_secret_name(name):
            out[f"engine.{name}"] = REDACTED
            continue
        if value.startswith(("{", "[")):
            with contextlib.suppress(ValueError):  # not JSON after all: kept as given
                value = json.dumps(_scrub(json.loads(value)), sort_keys=True, separators=(",", ":"))
        for secret in secrets:  # a key echoed inside another value stays out too
            value = value.replace(secret, REDACTED)
        out[f"engine.{name}"] = redact_url(value)
    return out


def parse_environ(raw: bytes) -> dict[str, str]:
    """``/proc/PID/environ`` (NUL-separated ``NAME=value``) as a dict."""
    out: dict[str, str] = {}
    for item in raw.decode("utf-8", "replace").split("\0"):
        name, sep, value = item.partition("=")
        if sep and name:
            out[name] = value
    return out


def listening_inodes(tables: list[str], port: int) -> set[str]:
    """Socket inodes listening on ``port`` in ``/proc/net/tcp``-format tables (any local address)."""
    inodes = set()
    for table in tables:
        for line in table.splitlines()[1:]:
            cols = line.split()
            if len(cols) < 10 or cols[3] != _TCP_LISTEN:
                continue
            _, _, hexport = cols[1].rpartition(":")
            if int(hexport, 16) == port and cols[9] != "0":
                inodes.add(cols[9])
    return inodes


def _holders(proc: Path, inodes: set[str]) -> list[int]:
    """Processes with one of the sockets open; those whose fds cannot be read (another user's) are skipped."""
    targets = {f"socket:[{i}]" for i in inodes}
    pids = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = os.listdir(entry / "fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(entry / "fd" / fd) in targets:
                    pids.append(int(entry.name))
                    break
            except OSError:
                continue
    return sorted(pids)


def server_facts(port: int, proc: Path = Path("/proc")) -> dict[str, str]:
    """``engine.*`` and ``env.*`` of the vLLM server listening on ``port`` on this host; never raises.

    Several processes hold a listening socket when vLLM forks (its engine core renames itself, so its
    command line is no longer vLLM's) or runs several API servers: the vLLM command lines among them must
    agree, or the answer is an ``engine.error``."""
    try:
        tables = []
        for name in ("tcp", "tcp6"):
            try:
                tables.append((proc / "net" / name).read_text(encoding="ascii", errors="replace"))
            except FileNotFoundError:
                continue
        inodes = listening_inodes(tables, port)
        if not inodes:
            return {"engine.error": f"no process listens on port {port} on this host"}
        pids = _holders(proc, inodes)
        if not pids:
            return {
                "engine.error": f"the process listening on port {port} cannot be read "
                "(canaryd must run as the server's user or as root)"
            }
        found: dict[int, list[str]] = {}
        others = []
        for pid in pids:
            raw = (proc / str(pid) / "cmdline").read_bytes().removesuffix(b"\0")
            argv = [a.decode("utf-8", "replace") for a in raw.split(b"\0")]
            args = vllm_args(argv)
            if args is None:
                others.append(os.path.basename(argv[0]) or "?")
            else:
                found[pid] = args
        if not found:
            return {"engine.error": f"the process listening on port {port} is not a vLLM server: {others[0]}"}
        if len({tuple(a) for a in found.values()}) > 1:
            return {
                "engine.error": f"several vLLM processes on port {port} were started with different arguments"
            }
        pid = min(found)
        fields = engine_fields(parse_args(found[pid]))
        fields.update(env_facts(parse_environ((proc / str(pid) / "environ").read_bytes())))
        return fields
    except (OSError, ValueError) as e:
        why = (
            e.strerror if isinstance(e, OSError) and e.strerror else str(e)[:200]
        )  # no pid: a field is stable
        return {"engine.error": f"cannot read the server process: {e.__class__.__name__}: {why}"}
