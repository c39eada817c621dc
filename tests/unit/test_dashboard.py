"""Static checks of the Grafana dashboard (no network): generated, importable, provisionable, linted.

promtool's parse of every panel query is in tests/e2e/test_dashboard.py; the live check (every panel query
returns data from a Prometheus that scraped a real canaryd) is in tests/e2e/test_daemon_e2e.py. Both use
``build_dashboard.panel_queries``.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from canaryd.daemon.metric_table import METRICS
from canaryd.daemon.metrics import Metrics
from canaryd.judge.compare import Verdict

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
GRAFANA = REPO / "grafana"
GENERATOR = GRAFANA / "build_dashboard.py"
DASHBOARD = GRAFANA / "canaryd-dashboard.json"

_spec = importlib.util.spec_from_file_location("build_dashboard", GENERATOR)
bd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bd)

DS_REF = {"type": "prometheus", "uid": "${datasource}"}
# Grafana unit ids the dashboard may use (plus "suffix:<text>" custom units).
UNITS = {"none", "short", "s", "ms", "percentunit", "percent", "reqps", "ops"}
METRIC = re.compile(r"\b(canaryd_[a-z0-9_]+)")
SELECTOR = re.compile(r"\b(canaryd_[a-z0-9_]+)\s*(\{[^}]*\})?")


@pytest.fixture(scope="module")
def dash() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def panels(dash) -> list[dict]:
    return bd.all_panels(dash)


@pytest.fixture(scope="module")
def exprs(dash, panels) -> list[tuple[str, str]]:
    """(where, raw expr) for every target and annotation, variables not substituted."""
    out = [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]
    out += [(f"annotation {a['name']}", a["expr"]) for a in dash["annotations"]["list"] if "expr" in a]
    return out


@functools.cache
def registry_names() -> dict[str, str]:
    """Sample names canaryd can export → family name, from the registry's metric families."""
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "summary": ("", "_sum", "_count", "_created"),
        "info": ("_info",),
    }
    names = {}
    for fam in Metrics().registry.collect():
        for suffix in suffixes.get(fam.type, ("",)):
            names[fam.name + suffix] = fam.name
    return names


# ---------------------------------------------------------------------------------------------- generator


def test_committed_json_is_current():
    r = subprocess.run([sys.executable, str(GENERATOR), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, f"stale dashboard, run python grafana/build_dashboard.py\n{r.stderr}"


def test_check_detects_stale_json(tmp_path):
    stale = tmp_path / "d.json"
    stale.write_text(DASHBOARD.read_text().replace("canaryd-overview", "something-else"))
    assert bd.main(["--check", "--output", str(stale)]) == 1
    assert bd.main(["--check", "--output", str(tmp_path / "missing.json")]) == 1
    assert bd.main(["--output", str(stale)]) == 0
    assert bd.main(["--check", "--output", str(stale)]) == 0


def test_the_generator_takes_metric_names_from_the_table():
    assert not re.findall(r"\bcanaryd_[a-z]+_\w+", GENERATOR.read_text())


def test_generation_is_deterministic():
    assert bd.render() == bd.render() == DASHBOARD.read_text()


# ---------------------------------------------------------------------------------------------- model


def test_classic_model_importable_and_provisionable(dash):
    text = DASHBOARD.read_text()
    assert dash["uid"] == "canaryd-overview"
    assert 8 <= len(dash["uid"]) <= 40
    assert dash["id"] is None
    assert dash["title"]
    assert "canaryd" in dash["tags"]
    assert isinstance(dash["schemaVersion"], int)
    assert "__inputs" not in dash and "__requires" not in dash
    assert "${DS_" not in text and "DS_PROMETHEUS" not in text


def test_template_variables(dash):
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    datasources = [v for v in variables.values() if v["type"] == "datasource"]
    assert len(datasources) == 1
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus" and ds["label"] == "Data source"
    assert ds["current"] == {}
    for name in ("job", "instance", "backend", "canary"):
        v = variables[name]
        assert v["type"] == "query"
        assert v["datasource"] == DS_REF
        assert v["multi"] and v["includeAll"] and v["allValue"] == ".+"
        assert v["refresh"] == 2, "refresh on time range change"
        assert v["query"].startswith("label_values(")
    assert variables["backend"]["query"].startswith("label_values(canaryd_canary_verdict")
    assert variables["backend"]["query"].endswith(", backend)")
    assert variables["canary"]["query"].endswith(", canary)")


def test_panels_have_description_unit_datasource(panels):
    assert len(panels) >= 15
    for p in panels:
        title = p.get("title")
        assert title, p
        assert p.get("description", "").strip(), f"{title}: no description"
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit")
        assert unit in UNITS or (unit or "").startswith("suffix:"), f"{title}: unit {unit!r}"
        assert p.get("datasource") == DS_REF, f"{title}: datasource {p.get('datasource')}"
        assert p.get("targets"), f"{title}: no targets"
        for t in p["targets"]:
            assert t.get("datasource") == DS_REF, f"{title}: target datasource"
            assert t.get("expr"), f"{title}: empty expr"
            assert t.get("refId"), f"{title}: no refId"
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), f"{title}: duplicate refIds"


def test_ids_unique_and_grid_within_24_columns(dash):
    everything = list(dash["panels"]) + [c for p in dash["panels"] for c in p.get("panels", [])]
    ids = [p["id"] for p in everything]
    assert all(isinstance(i, int) and i > 0 for i in ids)
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    assert len({p["title"] for p in everything}) == len(everything), "duplicate panel titles"
    cells = set()
    for p in everything:
        g = p["gridPos"]
        assert g["w"] > 0 and g["h"] > 0 and g["x"] >= 0 and g["y"] >= 0, p["title"]
        assert g["x"] + g["w"] <= 24, f"{p['title']}: gridPos {g} exceeds 24 columns"
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"{p['title']} overlaps another panel"
        cells |= mine


def test_required_panels_present(dash, panels):
    types = {p["title"]: p["type"] for p in panels}
    for title in ("Backends reachable", "Canaries drifting", "Regressions", "Probe success ratio"):
        assert types[title] == "stat"
    assert types["Verdict matrix"] == "table"
    assert types["Verdict history"] == "state-timeline"
    assert types["Max |Δ logprob| vs baseline"] == "timeseries"
    rows = [p["title"] for p in dash["panels"] if p["type"] == "row"]
    assert rows[0] == "Fleet overview"
    used = {m for _, e in bd.panel_queries(dash) for m in METRIC.findall(e)}
    for metric in (
        "canaryd_canary_logprob_delta_max",
        "canaryd_canary_probe_success",
        "canaryd_backend_probe_duration_seconds_bucket",
        "canaryd_backend_probe_failures_total",
        "canaryd_backend_probe_interval_seconds",
        "canaryd_backend_fingerprints",
        "canaryd_backend_stack_info",
        "canaryd_schedule_runs_total",
        "canaryd_schedule_missed_total",
        "canaryd_build_info",
    ):
        assert metric in used, metric


def test_stack_changes_are_an_annotation(dash):
    anns = [a for a in dash["annotations"]["list"] if a.get("expr")]
    assert len(anns) == 1
    a = anns[0]
    assert a["datasource"] == DS_REF and a["enable"]
    assert "canaryd_backend_stack_changes_total" in a["expr"] and "increase(" in a["expr"]
    assert a["expr"].rstrip().endswith("> 0")
    assert "{{backend}}" in a["titleFormat"]


# ---------------------------------------------------------------------------------------------- queries


def test_metric_names_exist_in_registry(exprs):
    names = registry_names()
    for where, expr in exprs:
        for metric in METRIC.findall(expr):
            assert metric in names, f"{where}: {metric} is not exported by canaryd.daemon.metrics.Metrics"


def test_every_metric_is_on_the_dashboard(exprs):
    """A new metric needs a panel, or ``drawn=False`` on its row of the metric table."""
    not_shown = {m.name for m in METRICS if not m.drawn}
    names = registry_names()
    used = {names[m] for _, e in exprs for m in METRIC.findall(e) if m in names}
    families = {f.name for f in Metrics().registry.collect() if f.name.startswith("canaryd_")}
    assert families - used - not_shown == set()
    assert used & not_shown == set(), "a panel queries a metric its table row says is not drawn"


def test_queries_filter_by_job_and_instance(exprs):
    for where, expr in exprs:
        for metric, matchers in SELECTOR.findall(expr):
            assert matchers, f"{where}: {metric} without label matchers"
            assert 'job=~"$job"' in matchers and 'instance=~"$instance"' in matchers, f"{where}: {metric}"
            if "backend" in _labels(metric):
                assert 'backend=~"$backend"' in matchers, f"{where}: {metric} ignores $backend"
            if "canary" in _labels(metric):
                assert 'canary=~"$canary"' in matchers, f"{where}: {metric} ignores $canary"


@functools.cache
def _family_labels() -> dict[str, set[str]]:
    """Family name → label names, from the declaration table (the registry omits them until set)."""
    return {m.name: set(m.labels) for m in METRICS}


def _labels(sample_name: str) -> set[str]:
    return _family_labels()[registry_names()[sample_name]]


def test_counters_only_under_rate_or_increase_with_grafana_windows(exprs):
    counter = re.compile(r"(\w+)\(\s*(canaryd_\w+_(?:total|bucket))\s*\{[^}]*\}\s*\[([^\]]+)\]")
    for where, expr in exprs:
        wrapped = counter.findall(expr)
        assert len(wrapped) == len(re.findall(r"canaryd_\w+_(?:total|bucket)\b", expr)), (
            f"{where}: a counter not directly inside rate()/increase(): {expr}"
        )
        for fn, metric, window in wrapped:
            assert fn in ("rate", "increase"), f"{where}: {fn}({metric})"
            assert window in ("$__rate_interval", "$__range"), f"{where}: {metric}[{window}]"


def test_panel_queries_substitutes_everything(dash, exprs):
    qs = bd.panel_queries(dash, {"backend": "drifty", "$canary": "(a|b)", "__rate_interval": "2m"})
    assert len(qs) == len(exprs)
    assert ("annotation: Stack changes", qs[-1][1]) == qs[-1]
    for title, q in qs:
        assert "$" not in q, f"{title}: {q}"
        if "backend=~" in q:
            assert 'backend=~"drifty"' in q
        if "canary=~" in q:
            assert 'canary=~"(a|b)"' in q
        assert "[1m]" not in q
    defaults = dict(bd.panel_queries(dash))
    assert 'job=~".+"' in defaults["Regressions"]
    assert "[1h]" in defaults["Probe success ratio"]
    with pytest.raises(KeyError):
        bd.substitute('up{x=~"$nope"}', dash)


def test_variable_queries(dash):
    got = {name: (sel, label) for name, sel, label in bd.variable_queries(dash, {"job": "canaryd"})}
    assert got["backend"] == ('canaryd_canary_verdict{job=~"canaryd", instance=~".+"}', "backend")
    assert set(got) == {"job", "instance", "backend", "canary"}


def test_verdict_panels_follow_the_verdict_table(panels):
    """Codes rise with severity (several instances: the worst verdict wins), colours and drift set as in
    canaryd.judge.verdicts, in the committed JSON as in the generator."""
    by_title = {p["title"]: p for p in panels}
    least_to_most = [(v.value, v.dashboard_color) for v in sorted(Verdict, key=lambda v: -v.rank)]
    assert list(bd.VERDICTS) == least_to_most
    for title in ("Verdict matrix", "Verdict history"):
        (mapping,) = by_title[title]["fieldConfig"]["defaults"]["mappings"]
        codes = {int(k): (o["text"], o["color"]) for k, o in mapping["options"].items()}
        assert [codes[i] for i in sorted(codes)] == least_to_most, title
        for code, (value, _) in enumerate(least_to_most):
            assert f'verdict="{value}"}} * {code}' in by_title[title]["targets"][0]["expr"], title
    drift = {v.value for v in Verdict if v.is_drift}
    assert set(bd.DRIFT_VERDICTS) == drift
    (matcher,) = re.findall(r'verdict=~"([^"]*)"', by_title["Canaries drifting"]["targets"][0]["expr"])
    assert set(matcher.split("|")) == drift
    assert all(f"{v.value}: " in by_title["Verdict matrix"]["description"] for v in Verdict)


# ---------------------------------------------------------------------------------------------- provisioning


def test_provisioning_examples():
    dashboards = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "canaryd.yml").read_text())
    assert dashboards["apiVersion"] == 1
    (provider,) = dashboards["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]
    assert provider["allowUiUpdates"] is False
    datasources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (ds,) = datasources["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] and ds["jsonData"]["timeInterval"]
