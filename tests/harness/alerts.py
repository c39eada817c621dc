"""Which shipped alerts page on drift: read from the rules file, so a drift alert added to the template is
counted by every test and bench that asks "did anything page?" without a list to keep in step."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from canaryd.daemon.metric_table import BY_ATTR
from canaryd.judge.verdicts import Verdict

RULES = Path(__file__).resolve().parents[2] / "prometheus" / "canaryd-alerts.yml"
_SELECTED = re.compile(r'verdict=~?"([^"]+)"')


def drift_alerts(rules: Path = RULES) -> tuple[str, ...]:
    """The alerts whose expression selects a drift verdict (`Verdict.is_drift`) or the drift alarm."""
    drift = {v.value for v in Verdict if v.is_drift}
    alarm = BY_ATTR["alarm"].sample
    names = []
    for group in yaml.safe_load(rules.read_text())["groups"]:
        for rule in group["rules"]:
            expr = rule.get("expr", "")
            selects = [re.fullmatch(pattern, v) for pattern in _SELECTED.findall(expr) for v in drift]
            if "alert" in rule and (any(selects) or re.search(rf"\b{alarm}\b", expr)):
                names.append(rule["alert"])
    return tuple(names)
