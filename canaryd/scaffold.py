"""`canaryd init`: a commented example config and a copy of the shipped default suite.

With ``--url`` the server there is asked which engine it is (`canaryd.backends.detect`) and the config's one
active backend is that engine's kind, with its base URL and the model it serves; the other kinds' blocks
stay as commented examples.

They hold no secrets (API keys never go in the config) and the service's own user must read them, so unlike
what else canaryd writes (private: `canaryd.files`) they are created 0644, in directories created 0755.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
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
