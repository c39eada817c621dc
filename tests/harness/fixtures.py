"""Recorded bodies under ``tests/fixtures/``: one JSON file per recording, in one format.

Every file is an object naming its origin in ``_source`` (a URL, a document's example, or the real server,
version and command it was recorded from), with what was recorded beside it: ``status``, ``headers`` and
``body`` for an HTTP answer (a text body, such as a Prometheus exposition, is a JSON string), and whatever
a test needs to replay it (``expect``, ``request``, ``_note``).
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "fixtures"


def load(name: str) -> dict:
    """The recording ``tests/fixtures/<name>.json`` (``name`` like ``"engines/sglang/chat"``)."""
    return read(ROOT / f"{name}.json")


def read(path: Path) -> dict:
    """One recording by its path; a file that does not say where it comes from is refused."""
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict) or not str(doc.get("_source", "")).strip():
        raise ValueError(f"{path}: a recording must name its origin in _source")
    return doc


def every(folder: str) -> list[Path]:
    """The recordings of one folder, sorted (``every("refusals")``)."""
    return sorted((ROOT / folder).glob("*.json"))
