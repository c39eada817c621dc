"""The package as a user gets it, and the cost of journald priorities, side by side in one run.

Package: `python -m build` (sdist, then the wheel from it) and the artifacts' sizes; an empty venv and
`pip install` of the wheel with its dependencies (from the configured index); the installed venv's size;
`canaryd --version` and `canaryd ops export` from it (median of 5). Logs: log lines per second written to a
file, as plain JSON and with the journald priority prefix (stderr is the "journal"), in separate processes.

    .venv/bin/python bench/package_bench.py
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINES = 20_000
EMIT = f"""
import time, structlog
from canaryd import log
log.configure("info")
logger = structlog.get_logger("canaryd")
t = time.perf_counter()
for i in range({LINES}):
    logger.warning("observation", backend="b", canary="c", verdict="identical", i=i)
print(time.perf_counter() - t)
"""


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "JOURNAL_STREAM")}


def timed(cmd: list, **kw) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env=kw.pop("env", clean_env()), **kw)
    return time.perf_counter() - start


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def log_rate(root: Path, journal: bool) -> float:
    out = root / ("journal.log" if journal else "plain.log")
    out.touch()
    env = dict(clean_env(), PYTHONPATH=str(REPO))
    if journal:
        st = out.stat()
        env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
    with out.open("wb") as err:
        p = subprocess.run(
            [sys.executable, "-c", EMIT], stderr=err, stdout=subprocess.PIPE, env=env, check=True
        )
    first = out.read_text().splitlines()[0]
    assert first.startswith("<4>") == journal, first
    return LINES / float(p.stdout)


def main() -> None:
    rows: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        dist, venv = root / "dist", root / "venv"
        rows.append(
            (
                "python -m build (sdist + wheel)",
                f"{timed([sys.executable, '-m', 'build', '-o', dist, REPO]):.1f} s",
            )
        )
        (sdist,), (wheel,) = dist.glob("*.tar.gz"), dist.glob("*.whl")
        rows.append(
            (
                "sdist / wheel size",
                f"{sdist.stat().st_size / 1024:.0f} KiB / {wheel.stat().st_size / 1024:.0f} KiB",
            )
        )
        rows.append(("empty venv", f"{timed([sys.executable, '-m', 'venv', venv]):.1f} s"))
        install = timed([venv / "bin/python", "-m", "pip", "install", "-q", wheel])
        rows.append(("pip install wheel + dependencies", f"{install:.1f} s"))
        rows.append(("installed venv size", f"{du(venv) / 2**20:.0f} MiB"))
        version = [timed([venv / "bin/canaryd", "--version"], cwd=root) for _ in range(5)]
        rows.append(("canaryd --version (median of 5)", f"{statistics.median(version) * 1000:.0f} ms"))
        export = [
            timed([venv / "bin/canaryd", "ops", "export", "--force", root / "ops"], cwd=root)
            for _ in range(5)
        ]
        rows.append(("canaryd ops export (median of 5)", f"{statistics.median(export) * 1000:.0f} ms"))
        rows.append(
            (
                "exported files, bytes",
                f"{sum(1 for f in (root / 'ops').rglob('*') if f.is_file())}, {du(root / 'ops'):,}",
            )
        )
        plain, journal = log_rate(root, False), log_rate(root, True)
        rows.append(("log lines/s: plain JSON vs journal-prefixed", f"{plain:,.0f} vs {journal:,.0f}"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
