"""The Prometheus alert rules through promtool: they pass its lint and its unit tests
(prometheus/canaryd-alerts.test.yml), and the example Prometheus config is valid.

Nothing here skips: without promtool (Debian's ``prometheus`` package) these tests fail, as CI must. The
static checks of the rules (mixin conventions, runbook links, exported metrics) are in
tests/unit/test_alert_rules.py.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
RULES = REPO / "prometheus" / "canaryd-alerts.yml"
RULE_TESTS = REPO / "prometheus" / "canaryd-alerts.test.yml"
PROM_CONFIG = REPO / "prometheus" / "prometheus.example.yml"


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool not found on PATH: install it with "
            "`apt-get install --no-install-recommends prometheus` (Debian ships promtool in the server "
            "package); the alert rules cannot be checked without it",
            pytrace=False,
        )
    return path


def _run(*args: str) -> None:
    proc = subprocess.run(
        [_promtool(), *args], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, (
        f"promtool {' '.join(args)} exited {proc.returncode}\n"
        f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    )


def test_promtool_check_rules() -> None:
    _run("check", "rules", "--lint=all", "--lint-fatal", str(RULES.relative_to(REPO)))


def test_promtool_test_rules() -> None:
    _run("test", "rules", str(RULE_TESTS.relative_to(REPO)))


def test_promtool_check_example_config() -> None:
    _run("check", "config", str(PROM_CONFIG.relative_to(REPO)))
