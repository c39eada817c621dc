"""The Grafana dashboard's panel queries through promtool (Debian's ``prometheus`` package): each one, its
variables substituted, parses as PromQL. Without promtool this fails, as CI must (it used to skip).

The static checks of the dashboard are in tests/unit/test_dashboard.py; the live check (every panel query
returns data from a real Prometheus) is in tests/e2e/test_daemon_e2e.py.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

from tests.e2e.services import need

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
DASHBOARD = REPO / "grafana" / "canaryd-dashboard.json"
_spec = importlib.util.spec_from_file_location("build_dashboard", REPO / "grafana" / "build_dashboard.py")
bd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bd)


@pytest.fixture(scope="module")
def dash() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_queries_parse_with_promtool(dash, tmp_path):
    """Each substituted query, wrapped in a throw-away recording rule, passes ``promtool check rules``."""
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query{i}", "expr": q}
                    for i, (_, q) in enumerate(bd.panel_queries(dash))
                ],
            }
        ]
    }
    path = tmp_path / "rules.yml"
    path.write_text(json.dumps(rules))  # JSON is YAML
    r = subprocess.run([need("promtool"), "check", "rules", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
