"""Helpers shared by the hostile-input tests: a config on the scripted kind, the CLI as a subprocess."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx2

from tests.harness.scripted_lab import free_port, scripted

SLOW = "^(a|a)*$"  # backtracks catastrophically in `regex` too (the issue's ^(a+)+$ it optimises)
SLOW_ANSWER = "a" * 40 + "!"
SLOW_SUITE = f"""
[suite]
name = "slow"
[[canary]]
id = "slow"
messages = [{{ role = "user", content = "Say a." }}]
decoding = {{ max_tokens = 64 }}
expect = {{ regex = "{SLOW}" }}
"""
ENV = {**os.environ, "NO_COLOR": "1", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}


def write_config(
    root: Path, suites: list[str], backends: str | None = None, tail: str = "", port: int | None = None
) -> Path:
    """A config in ``root``: state in ``root/state``, metrics on ``port`` (default: a free one)."""
    path = root / "canaryd.toml"
    path.write_text(
        f'state_dir = "state"\nsuites = {json.dumps(suites)}\n'
        + (backends or scripted(answers={"slow": SLOW_ANSWER}))
        + f'\n[daemon]\nlisten = "127.0.0.1:{port or free_port()}"\ninstance = "unit"\n{tail}'
    )
    return path


def canaryd(
    cfg: Path | None, *args: str, umask: int = -1, timeout: float = 60
) -> subprocess.CompletedProcess:
    pre = ["-c", str(cfg)] if cfg is not None else []
    return subprocess.run(
        [sys.executable, "-m", "canaryd", *pre, *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=timeout,
        umask=umask,
    )


def one_error_line(p: subprocess.CompletedProcess) -> str:
    lines = [line for line in p.stderr.splitlines() if line.startswith("canaryd: error:")]
    assert "Traceback" not in p.stderr, p.stderr
    assert len(lines) == 1, p.stderr
    return lines[0]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def scrape(port: int) -> tuple[int, float]:
    t = time.monotonic()
    r = httpx2.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
    return r.status_code, time.monotonic() - t
