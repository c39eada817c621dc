"""The files canaryd writes out for others to read: `canaryd init`'s example config and default suite, and
`canaryd ops export`'s operations files.

`canaryd init`: a commented example config and a copy of the shipped default suite.

With ``--url`` the server there is asked which engine it is (`canaryd.backends.detect`) and the config's one
active backend is that engine's kind, with its base URL and the model it serves; the other kinds' blocks
stay as commented examples.

They hold no secrets (API keys never go in the config) and the service's own user must read them, so unlike
what else canaryd writes (private: `canaryd.files`) they are created 0644, in directories created 0755.

`canaryd ops export`: the alert rules and their tests, the Grafana dashboard (and provisioning examples),
the systemd unit and the runbook live in the repository's top-level folders; `canaryd/_shipped/` holds
symlinks to them (one copy of each in git) and a built wheel holds their contents. So `pip install
llm-canaryd` is enough to get them: no checkout, and the files always match the installed version's metrics
and alerts. Other users (prometheus, grafana, systemd) read them too: 0644 and 0755 likewise.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from canaryd.backends import KINDS, examples
from canaryd.errors import InputError

if TYPE_CHECKING:
    from canaryd.backends.detect import Detection

_TEMPLATE = """\
# canaryd configuration. Reference: README.md ("Configuration") and docs/configuration.md.
# Relative paths are resolved against this file's directory.

# Top-level keys come first: in TOML, keys after a [[table]] header belong to that table.

# Canary files. A suite may be limited to some backends:
#   suites = [{ path = "canaries/default.toml", backends = ["local-vllm"] }]
suites = ["canaries/default.toml"]

# Where the SQLite history lives (default: $STATE_DIRECTORY, else ~/.local/state/canaryd).
# state_dir = "/var/lib/canaryd"

[daemon]
listen = "127.0.0.1:9464"       # Prometheus metrics; loopback unless you mean it
fingerprint_window = "1h"       # distinct system_fingerprints are counted over this window

# When `canaryd run` probes what (default: everything every 5 minutes). Durations: 30s, 5m, 1h30m.
[[schedules]]
name = "default"
every = "5m"                    # or cron = "*/5 * * * *" (UTC)
jitter = "30s"
# backends = ["local-vllm"]     # default: all
# suites = ["default"]          # suite names; default: all

{backends}
[storage]
# SQLAlchemy URL; default sqlite:///<state_dir>/canaryd.db. PostgreSQL for fleets:
# url = "postgresql+psycopg://canaryd@db/canaryd"

[compare]
# Largest |delta logprob| still called identical. 0 (the default): any change counts, which is right
# for a batch-invariant or otherwise deterministic engine. Raise it for noisy engines, or better,
# measure the noise: `canaryd baseline calibrate` sends each canary calibration_k times (alone and
# beside filler requests) and then decides by statistics, not by this tolerance.
logprob_tolerance = 0.0
# calibration_k = 20
# calibration_batch_sizes = [1, 8]
# arl = 10000       # mean cycles between false alarms of calibrated canaries, at least
# min_out = 4       # calibrated canaries out in one cycle to alarm (default: derived from arl)
# alpha = 0.001     # sampled canaries (samples > 1): false-alarm rate per comparison
"""


def example(found: Detection | None = None, url: str | None = None) -> str:
    """The example config, with a block for each backend kind that offers one; given what answered at
    ``url``, that engine's block is the active one and every example is commented out."""
    if found is None or url is None:
        return _TEMPLATE.replace("{backends}", "\n".join(examples()))
    blocks = [detected_block(found, url), *map(_commented, examples())]
    return _TEMPLATE.replace("{backends}", "\n".join(blocks))


def detected_block(found: Detection, url: str) -> str:
    """The ``[[backends]]`` block of the engine found at ``url``: its kind when this canaryd registers it,
    else ``openai`` (said in a comment), with the model ``/v1/models`` named."""
    from canaryd.backends.detect import root_of

    kind = found.kind if found.kind in KINDS else "openai"
    lines = [f"# `canaryd init --url` asked {root_of(url)}: {found.evidence}"]
    if kind != found.kind:
        lines.append(f"# (this canaryd has no kind {found.kind!r}: watched as a plain OpenAI-compatible API)")
    model = json.dumps(found.model) if found.model else '"my-model"          # the served model name'
    lines += [
        "[[backends]]",
        f'name = "{kind}"',
        f'kind = "{kind}"',
        f"base_url = {json.dumps(root_of(url) + '/v1')}",
        f"model = {model}",
    ]
    return "\n".join(lines) + "\n"


def _commented(block: str) -> str:
    return "".join(
        line if line.startswith("#") or not line.strip() else f"# {line}" for line in block.splitlines(True)
    )


def shipped_canaries() -> Path:
    """The `canaries/` directory of a source checkout or of an installed wheel's data files."""
    for candidate in (
        Path(__file__).resolve().parents[1] / "canaries",
        Path(sys.prefix) / "share/canaryd/canaries",
    ):
        if (candidate / "default.toml").exists():
            return candidate
    raise InputError("cannot find the shipped canaries/default.toml (reinstall canaryd)")


def write_example(
    path: Path, *, force: bool = False, found: Detection | None = None, url: str | None = None
) -> list[Path]:
    """Write the example config at ``path`` (into it, as ``canaryd.toml``, when it is a directory) and
    the default suite beside it; an existing file is an `InputError` (exit 2) unless ``force``. ``found``:
    the engine `detect` found at ``url``, whose block the config gets."""
    if path.is_dir():
        path = path / "canaryd.toml"
    suite = path.parent / "canaries" / "default.toml"
    existing = [str(t) for t in (path, suite) if t.exists()]
    if existing and not force:
        raise InputError(f"{', '.join(existing)}: already exists, not overwritten (use --force to overwrite)")
    new = [t for t in (path, suite) if not t.exists()]
    _mkdir(path.parent)
    path.write_text(example(found, url), encoding="utf-8")
    _mkdir(suite.parent)
    shutil.copyfile(shipped_canaries() / "default.toml", suite)
    for written in new:  # readable by the service whatever the umask (canaryd's own is 0077)
        os.chmod(written, 0o644)
    return [path, suite]


def _mkdir(directory: Path) -> None:
    """Create ``directory`` (and its parents) 0755; an existing one is left as it is."""
    missing = [d for d in (directory, *directory.parents) if not d.exists()]
    directory.mkdir(parents=True, exist_ok=True)
    for d in missing:
        os.chmod(d, 0o755)


def shipped() -> dict[PurePosixPath, Traversable]:
    """Every shipped file by its repository-relative path (``prometheus/canaryd-alerts.yml``), sorted."""
    found: dict[PurePosixPath, Traversable] = {}
    todo = [(PurePosixPath(), files("canaryd") / "_shipped")]
    while todo:
        rel, node = todo.pop()
        for child in node.iterdir():
            if child.is_dir():
                todo.append((rel / child.name, child))
            else:
                found[rel / child.name] = child
    if not found:
        raise InputError("the package holds no shipped operations files (reinstall llm-canaryd)")
    return dict(sorted(found.items()))


def export_files(dest: Path, force: bool = False) -> list[Path]:
    """Write every shipped file under ``dest`` at its repository-relative path; return the paths written.

    Nothing is written if any target exists and ``force`` is false, so a refused export leaves no half-set.
    With ``force`` a target is replaced (a symlink there is replaced, not followed).
    """
    sources = shipped()
    targets = {rel: dest.joinpath(*rel.parts) for rel in sources}
    if dest.exists() and not dest.is_dir():
        raise InputError(f"{dest}: not a directory")
    if not force:
        taken = [t for t in targets.values() if os.path.lexists(t)]
        if taken:
            more = f" (and {len(taken) - 1} more)" if len(taken) > 1 else ""
            raise InputError(f"{taken[0]}: already exists{more} (use --force to overwrite)")
    for rel, target in targets.items():
        try:
            _mkdir(target.parent)
            _write(target, sources[rel].read_bytes())
        except OSError as e:
            culprit = e.filename2 or e.filename  # a rename's target, else the path the call failed on
            where = f"{culprit}: {e.strerror}" if culprit and e.strerror else str(e)
            raise InputError(f"{target}: cannot write ({where})") from None
    return list(targets.values())


def _write(target: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``target``, then rename it over: never half a file."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
