"""`canaryd ops export`: the operations files that ship inside the package, written out for an operator.

The alert rules and their tests, the Grafana dashboard (and provisioning examples), the systemd unit and the
runbook live in the repository's top-level folders; `canaryd/_shipped/` holds symlinks to them (one copy of
each in git) and a built wheel holds their contents. So `pip install llm-canaryd` is enough to get them:
no checkout, and the files always match the installed version's metrics and alerts.

Like `canaryd init`'s files they hold no secrets and other users (prometheus, grafana, systemd) read them,
so they are written 0644 in directories created 0755, whatever canaryd's private umask.
"""

from __future__ import annotations

import os
import tempfile
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path, PurePosixPath

from canaryd.errors import InputError


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


def _mkdir(directory: Path) -> None:
    """Create ``directory`` (and its parents) 0755; an existing one is left as it is."""
    missing = [d for d in (directory, *directory.parents) if not d.exists()]
    directory.mkdir(parents=True, exist_ok=True)
    for d in missing:
        os.chmod(d, 0o755)


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
