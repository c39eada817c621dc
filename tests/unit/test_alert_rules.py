"""The Prometheus alert rules follow the mixin conventions (promtool's checks of them are in
tests/e2e/test_alert_rules.py).

The checks here replicate mixtool's alert lint, tie every ``runbook_url`` to a heading of the runbook the
metrics server serves at ``/runbook``, check every metric, label and enum value the rules (and the queries
in their annotations) use against what ``canaryd.daemon.metrics.Metrics`` exports, and hold the generated
rules file to its template and job selector (``prometheus/build_rules.py``).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml

from canaryd.daemon.httpserver import runbook_html, runbook_markdown
from canaryd.judge.verdicts import Verdict
from canaryd.observation import ErrorKind

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
RULES = REPO / "prometheus" / "canaryd-alerts.yml"
RULE_TESTS = REPO / "prometheus" / "canaryd-alerts.test.yml"
RUNBOOK = REPO / "docs" / "runbook.md"
# Served by the canaryd that raised the alert (the runbook of its version); a canaryd that cannot be
# reached cannot serve it, so its own alerts link online.
RUNBOOK_URL = "http://{{ $labels.instance }}/runbook#"
FALLBACK_URL = "https://github.com/canaryd/canaryd/blob/main/docs/runbook.md#"
UNREACHABLE = {"CanarydDown", "CanarydTargetMissing"}
_spec = importlib.util.spec_from_file_location("build_rules", REPO / "prometheus" / "build_rules.py")
build_rules = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_rules)

# Series Prometheus itself adds to every scrape, and the labels it attaches to canaryd's series.
SYNTHETIC_METRICS = {"up"}
TARGET_LABELS = {"job", "instance"}
# Alerts an end-to-end test waits for: they must fire within a minute of the probe that saw the change.
FAST_ALERTS = {
    "CanarydDriftEvidence",
    "CanarydRegression",
    "CanarydReferenceMismatch",
    "CanarydAnswerChanged",
    "CanarydDeterminismBroken",
    "CanarydLogprobDrift",
    "CanarydStackChanged",
    "CanarydFingerprintChurn",
}
ENUM_LABELS = {"verdict": {v.value for v in Verdict}, "reason": {k.value for k in ErrorKind}}

PROMQL_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right"}
PROMQL_KEYWORDS |= {"bool", "offset", "inf", "nan"}


# -- the rule files ----------------------------------------------------------------------------------------


@cache
def _alerts() -> tuple[dict, ...]:
    doc = yaml.safe_load(RULES.read_text())
    assert [g["name"] for g in doc["groups"]] == ["canaryd"], "one rule group, named canaryd"
    return tuple(r for g in doc["groups"] for r in g["rules"] if "alert" in r)


ALERT_NAMES = [a["alert"] for a in _alerts()]


def _alert(name: str) -> dict:
    return next(a for a in _alerts() if a["alert"] == name)


def _duration_s(d: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    parts = re.findall(r"(\d+)(ms|[smhdwy])", d)
    assert parts and "".join(n + u for n, u in parts) == d, f"not a Prometheus duration: {d!r}"
    return sum(int(n) * units[u] for n, u in parts)


def test_required_alerts_present() -> None:
    required = {
        "CanarydAnswerChanged",
        "CanarydRegression",
        "CanarydDeterminismBroken",
        "CanarydLogprobDrift",
        "CanarydStackChanged",
        "CanarydFingerprintChurn",
        "CanarydProbesFailing",
        "CanarydCanariesStale",
        "CanarydBackendUnreachable",
    }
    assert required <= set(ALERT_NAMES)
    assert len(ALERT_NAMES) == len(set(ALERT_NAMES)), "duplicate alert names"


@pytest.mark.parametrize("name", ALERT_NAMES)
def test_alert_style(name: str) -> None:
    """mixtool's lint (monitoring-mixins conventions), plus `for:` and a runbook link on every alert."""
    a = _alert(name)
    assert re.fullmatch(r"([A-Z]+[a-z0-9]+)+", name), "alert names are CamelCase"
    assert name.startswith("Canaryd"), "alert names share the Canaryd prefix"
    assert "for" in a, "every alert needs a `for:`"
    for_s = _duration_s(str(a["for"]))
    if name in FAST_ALERTS:
        assert for_s <= 60, "drift and stack alerts must fire within a minute (for: 1m or less)"
    assert a.get("labels", {}).get("severity") in {"critical", "warning", "info"}
    ann = a.get("annotations", {})
    assert set(ann) >= {"summary", "description", "runbook_url"}
    assert "{{" not in ann["summary"], "summary must be static (it heads grouped notifications)"
    assert re.fullmatch(r"[A-Z].+\.", ann["summary"]), "summary: a sentence, capitalised, ending in a period"
    assert re.search(r"\{\{.*\}\}", ann["description"]), "description must be templated"
    assert ann["runbook_url"] == (FALLBACK_URL if name in UNREACHABLE else RUNBOOK_URL) + name.lower()


def _github_anchor(heading: str) -> str:
    """GitHub's heading slug: lowercase, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_runbook_sections_match_alerts() -> None:
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", RUNBOOK.read_text(), flags=re.M)
    anchors = {_github_anchor(h) for h in headings}
    # the runbook /runbook serves (package data) is this one, with these anchors as HTML ids
    assert runbook_markdown() == RUNBOOK.read_bytes()
    assert set(re.findall(r'<h\d id="([^"]+)"', runbook_html(RUNBOOK.read_text()).decode())) == anchors
    missing = [
        a["alert"] for a in _alerts() if a["annotations"]["runbook_url"].split("#", 1)[1] not in anchors
    ]
    assert not missing, f"docs/runbook.md has no section for {missing}"
    orphans = {h for h in headings if h.startswith("Canaryd")} - set(ALERT_NAMES)
    assert not orphans, f"runbook sections for alerts that do not exist: {sorted(orphans)}"


def test_every_alert_tested_firing_and_quiet() -> None:
    doc = yaml.safe_load(RULE_TESTS.read_text())
    firing, quiet = set(), set()
    for t in doc["tests"]:
        for case in t.get("alert_rule_test", []):
            (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
    assert (firing | quiet) <= set(ALERT_NAMES), (
        f"tests of unknown alerts: {(firing | quiet) - set(ALERT_NAMES)}"
    )
    assert set(ALERT_NAMES) <= firing, f"never tested firing: {sorted(set(ALERT_NAMES) - firing)}"
    assert set(ALERT_NAMES) <= quiet, f"never tested not firing: {sorted(set(ALERT_NAMES) - quiet)}"


# -- metrics, labels and enum values against canaryd.daemon.metrics -----------------------------------------


@cache
def _exported() -> dict[str, set[str]]:
    """Every series name canaryd exports (as Prometheus sees it), with its label names."""
    from prometheus_client.metrics import MetricWrapperBase

    from canaryd.daemon.metric_table import PAIR_FAMILIES
    from canaryd.daemon.metrics import Metrics

    m = Metrics()
    suffixes = {
        "counter": ("_total",),
        "gauge": ("",),
        "histogram": ("_bucket", "_sum", "_count"),
        "info": ("_info",),
    }
    out: dict[str, set[str]] = {}
    for metric in vars(m).values():
        if not isinstance(metric, MetricWrapperBase):
            continue
        labels = set(metric._labelnames)  # the constructor's labelnames
        for suffix in suffixes[metric._type]:
            out[metric._name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    for f in PAIR_FAMILIES:
        out[f.name] = set(f.labels)
    assert "canaryd_backend_probes_total" in out and "canaryd_canary_verdict" in out
    return out


def _parse_promql(expr: str) -> tuple[set[str], list[tuple[str | None, str, str]], set[str]]:
    """Metric names, (metric, label, value) equality matchers, and label names in grouping clauses.

    A deliberately small scanner, enough for the rules canaryd ships: it strips strings, selectors, ranges
    and grouping clauses, then takes every identifier that is not a keyword or a function call.
    """
    matchers: list[tuple[str | None, str, str]] = []
    for name, body in re.findall(r"([a-zA-Z_:][\w:]*)?\s*\{([^}]*)\}", expr):
        for label, op, value in re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"', body):
            if op == "=":
                matchers.append((name or None, label, value))
            else:
                matchers.append((name or None, label, ""))
    stripped = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)
    stripped = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", stripped)
    grouping: set[str] = set()
    clause = r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)"
    for labels in re.findall(clause, stripped):
        grouping |= {x.strip() for x in labels.split(",") if x.strip()}
    stripped = re.sub(clause, " ", stripped)
    names = {
        tok
        for tok in re.findall(r"(?<![\w.:])([a-zA-Z_:][\w:]*)(?![\w:])(?!\s*\()", stripped)
        if tok.lower() not in PROMQL_KEYWORDS
    }
    return names, matchers, grouping


def _queries(alert: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for the alert's expr and for every query its annotations run (Go raw strings)."""
    out = [("expr", alert["expr"])]
    for key, text in alert.get("annotations", {}).items():
        out += [(f"annotations.{key}", q.replace("%q", '"x"')) for q in re.findall(r"`([^`]*)`", text)]
    return out


@pytest.mark.parametrize("name", ALERT_NAMES)
def test_alert_uses_only_exported_metrics(name: str) -> None:
    exported = _exported()
    known_labels = set().union(*exported.values()) | TARGET_LABELS
    for where, query in _queries(_alert(name)):
        names, matchers, grouping = _parse_promql(query)
        assert names, f"{where}: no metric found in {query!r}"
        unknown = names - set(exported) - SYNTHETIC_METRICS
        assert not unknown, f"{where}: canaryd exports no {sorted(unknown)} (query {query!r})"
        assert grouping <= known_labels, f"{where}: unknown labels {sorted(grouping - known_labels)}"
        for metric, label, value in matchers:
            if metric in exported:
                assert label in exported[metric] | TARGET_LABELS, f"{where}: {metric} has no label {label!r}"
            else:
                assert label in known_labels, f"{where}: unknown label {label!r}"
            if label in ENUM_LABELS and value:
                assert value in ENUM_LABELS[label], f"{where}: {label}={value!r} is not one canaryd sets"
        for label, alternatives in re.findall(r'(\w+)\s*=~\s*"([\w|-]*)"', query):
            unknown = set(alternatives.split("|")) - ENUM_LABELS.get(label, set(alternatives.split("|")))
            assert not unknown, f"{where}: {label}=~ names {sorted(unknown)}, which canaryd never sets"


def test_alerts_fire_on_every_drift_verdict_and_no_other() -> None:
    """Each drift verdict of the verdict table has a fast alert selecting it; no alert pages on another."""
    alerts: dict[str, set[str]] = {}
    for a in _alerts():
        for metric, label, value in _parse_promql(a["expr"])[1]:
            if metric == "canaryd_canary_verdict" and label == "verdict" and value:
                alerts.setdefault(value, set()).add(a["alert"])
    assert set(alerts) == {v.value for v in Verdict if v.is_drift}, alerts
    sections = dict(re.findall(r"^## (\w+)\n(.*?)(?=^## |\Z)", RUNBOOK.read_text(), flags=re.M | re.S))
    for verdict, names in alerts.items():
        assert names <= FAST_ALERTS, f"{verdict}: {sorted(names - FAST_ALERTS)} must fire within a minute"
        for name in names:
            assert f"`{verdict}`" in sections[name], f"docs/runbook.md, {name}: name the verdict `{verdict}`"


def test_promql_scanner() -> None:
    names, matchers, grouping = _parse_promql(
        'count by (backend) (canaryd_canary_verdict{verdict="logprob-drift"} == 1) > 0 '
        "unless on (backend) (rate(canaryd_backend_probes_total[5m] offset 1m) > bool 0) or up"
    )
    assert names == {"canaryd_canary_verdict", "canaryd_backend_probes_total", "up"}
    assert matchers == [("canaryd_canary_verdict", "verdict", "logprob-drift")]
    assert grouping == {"backend"}


# -- the generated rules file and its job selector ---------------------------------------------------------


def test_committed_rules_are_generated() -> None:
    r = subprocess.run(
        [sys.executable, str(REPO / "prometheus" / "build_rules.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, f"stale rules, run python prometheus/build_rules.py\n{r.stderr}"


def test_every_selector_carries_the_job_selector() -> None:
    """Each canaryd series and ``up``, in every expr and annotation query, is selected by the selector, so
    another selector makes rules for another job and nothing of the default one is left."""
    other = yaml.safe_load(build_rules.render('job="llm-canaries", env="prod"'))
    rules = [r for g in other["groups"] for r in g["rules"]]
    selectors = 0
    for rule in rules:
        for where, query in _queries(rule):
            assert 'job="canaryd"' not in query, f"{rule['alert']} {where}"
            for metric, body in re.findall(r"\b(canaryd_\w+|up)\s*(\{[^}]*\})?", query):
                assert body.startswith('{job="llm-canaries", env="prod"'), (
                    f"{rule['alert']} {where}: {metric}"
                )
                selectors += 1
    assert selectors > len(rules)


def test_selector_is_checked() -> None:
    for bad in ("", 'job=~"a%"', "job=`x`"):
        with pytest.raises(ValueError, match="--selector"):
            build_rules.render(bad)
    assert build_rules.main(["--selector", "", "--check"]) == 2


def test_a_vanished_target_is_covered() -> None:
    """``up == 0`` needs a target; an absent()-style alert covers one that service discovery dropped."""
    expr = _alert("CanarydTargetMissing")["expr"]
    assert "absent(up{" in expr and "unless up{" in expr


def test_the_template_takes_metrics_from_the_table(tmp_path, monkeypatch) -> None:
    """The template writes no metric by name, only by its row of canaryd's metric table, and a ``$name``
    that is neither a row nor a Go template variable stops the build."""
    assert not re.search(r"canaryd_\w", build_rules.TEMPLATE.read_text())
    template = tmp_path / "t.yml"
    template.write_text("expr: increase($probes{$selector}[5m]) > 0 and $labels.backend\n")
    monkeypatch.setattr(build_rules, "TEMPLATE", template)
    assert (
        build_rules.render()
        == 'expr: increase(canaryd_backend_probes_total{job="canaryd"}[5m]) > 0 and $labels.backend\n'
    )
    template.write_text("expr: $probez{$selector} > 0\n")
    with pytest.raises(ValueError, match=r"\$probez: no such metric"):
        build_rules.render()
