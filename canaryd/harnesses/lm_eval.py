"""canaryd around lm-evaluation-harness: the record beside the results file it describes.

lm-eval offers no callback a tool can register: its `EvaluationTracker` (``lm_eval/loggers/
evaluation_tracker.py``) is built by the CLI itself and writes ``<output_path>/<model>/results_<date>.json``
with the task hashes, the task configs and the sample counts (``n-samples``). So canaryd wraps the command
(``canaryd preflight --pin … --out DIR -- lm_eval run … --output_path DIR``): the gate refuses a moved
stack before lm-eval starts, and afterwards the results file the run wrote is found here and read, so that
the record is written beside it (``canaryd-record.results_<date>.json``, a name lm-eval's own
readers of ``results_*.json`` pass by) and names it, its task hashes and
its samples.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Results:
    """One lm-eval results file, as the record cites it."""

    path: Path
    tasks: tuple[str, ...]
    task_hashes: dict[str, str]
    samples: int
    model: str

    def as_dict(self) -> dict:
        return {
            "harness": "lm-eval",
            "results": str(self.path),
            "tasks": list(self.tasks),
            "task_hashes": self.task_hashes,
            "samples": self.samples,
            "model": self.model,
        }


def written_since(out_dir: Path, since: float) -> list[Path]:
    """The results files lm-eval wrote under ``out_dir`` from ``since`` (a time.time()), oldest first."""
    if not out_dir.is_dir():
        return []
    found = [p for p in out_dir.rglob("results_*.json") if p.is_file() and p.stat().st_mtime >= since]
    return sorted(found, key=lambda p: p.stat().st_mtime)


def read_results(path: Path) -> Results | None:
    """The file as lm-eval writes it; None when it is not one (another tool's ``results_*.json``)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), dict):
        return None
    counts = doc.get("n-samples") if isinstance(doc.get("n-samples"), dict) else {}
    samples = sum(int(v.get("effective", 0)) for v in counts.values() if isinstance(v, dict))
    hashes = doc.get("task_hashes") if isinstance(doc.get("task_hashes"), dict) else {}
    return Results(
        path,
        tuple(sorted(doc["results"])),
        {str(k): str(v) for k, v in hashes.items()},
        samples,
        str(doc.get("model_name", "")),
    )
