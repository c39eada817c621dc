#!/usr/bin/env python3
"""Generate ``grafana/canaryd-dashboard.json`` (Grafana Classic JSON model) from code.

Edit this script, never the JSON. ``python grafana/build_dashboard.py`` rewrites the JSON;
``python grafana/build_dashboard.py --check`` exits 1 if the committed JSON differs from what this script
generates (CI and ``tests/unit/test_dashboard.py`` run it).

The dashboard is built with Grafana's own Python SDK (``grafana-foundation-sdk``, the Grafana 11.6 build,
pinned exactly because its versions carry epoch prefixes: ``grafana-foundation-sdk==1769699379!11.6.0``).
A few things the SDK's builders don't express are patched on the built dict in :func:`build_dashboard`
(``"id": null``, ``"current": {}`` on the datasource variable, Prometheus annotation fields).

Conventions (see the README): a ``datasource`` variable (no ``__inputs``, so both UI import and file
provisioning work), ``job``/``instance``/``backend``/``canary`` variables, ``$__rate_interval`` in every
``rate``/``increase`` over a scrape window, and a description and unit on every panel. Metric names come
from canaryd's metric table (``canaryd/daemon/metric_table.py``) through `N` (names) and `S`/`sel`
(selectors), never typed here; each dashboard row is one ``*_row`` function, listed in `ROWS`.

:func:`panel_queries` returns every panel target and annotation expression with the template variables
substituted, for tests that evaluate them against a real Prometheus.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.builders import prometheus as prom_b
from grafana_foundation_sdk.builders import stat, statetimeline, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as common_m
from grafana_foundation_sdk.models import dashboard as dash_m
from grafana_foundation_sdk.models import prometheus as prom_m

from canaryd.daemon.metric_table import BY_ATTR
from canaryd.judge.verdicts import Verdict

HERE = Path(__file__).resolve().parent
OUTPUT = HERE / "canaryd-dashboard.json"
UID = "canaryd-overview"
TITLE = "canaryd: canary drift overview"

DS = dash_m.DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"
RANGE = "$__range"
# Minimum query interval of panels that count probes per $__rate_interval: canaryd's default probe period, so
# that each window holds a probe pass (Grafana makes $__rate_interval at least $__interval + scrape interval).
PROBE_PERIOD = "5m"

# Label matchers every query carries.
JOB = 'job=~"$job", instance=~"$instance"'
BACKEND = JOB + ', backend=~"$backend"'
CANARY = BACKEND + ', canary=~"$canary"'


def sel(attr: str, *matchers: str, suffix: str = "") -> str:
    """The series of the metric table's family ``attr`` (`canaryd.daemon.metric_table`) as a selector, by
    the variables for the labels it has ($job and $instance always, $backend and $canary where it has
    them), then ``matchers``. ``suffix``: a histogram's ``_bucket``."""
    m = BY_ATTR[attr]
    scope = CANARY if "canary" in m.labels else BACKEND if "backend" in m.labels else JOB
    return f"{m.sample}{suffix}{{{', '.join((scope, *matchers))}}}"


class _Table:
    """``N.probes``: a family's name as PromQL selects it (a counter's with ``_total``); ``S.probes``: its
    selector (`sel`). An attribute that is no row of the table fails the build."""

    def __init__(self, render) -> None:
        self._render = render

    def __getattr__(self, attr: str) -> str:
        return self._render(attr)


N = _Table(lambda attr: BY_ATTR[attr].sample)
S = _Table(sel)

# (value, colour) of every verdict, from the table in canaryd.judge.verdicts, least to most severe: the index
# is the code the verdict panels map, so the most severe verdict has the highest code.
VERDICTS: tuple[tuple[str, str], ...] = tuple((v.value, v.dashboard_color) for v in reversed(Verdict))
DRIFT_VERDICTS = tuple(v.value for v in Verdict if v.is_drift)

# Grafana built-ins as panel_queries substitutes them unless told otherwise.
BUILTIN_DEFAULTS = {"__rate_interval": "1m", "__range": "1h", "__interval": "15s"}


# ---------------------------------------------------------------------------------------------- queries


def verdict_code_expr(matchers: str = CANARY) -> str:
    """The current verdict of each backend × canary as a number (index into VERDICTS).

    The verdict family has one series per pair, labelled with the last probe's verdict (value 1),
    so the union of ``gauge × code`` over the verdicts is the code of the current one. Several canaryd
    instances probing the same backend: the worst verdict wins.
    """
    terms = " or ".join(
        f'{N.verdict}{{{matchers}, verdict="{v}"}} * {i}' for i, (v, _) in enumerate(VERDICTS)
    )
    return f"max by (backend, canary) (sum by (job, instance, backend, canary) ({terms}))"


def verdict_mappings() -> list[dash_m.ValueMap]:
    return [
        dash_m.ValueMap(
            options={
                str(i): dash_m.ValueMappingResult(text=v, color=color, index=i)
                for i, (v, color) in enumerate(VERDICTS)
            }
        )
    ]


def bool_mappings(
    true_text: str, false_text: str, false_color: str = "red", true_color: str = "green"
) -> list[dash_m.ValueMap]:
    return [
        dash_m.ValueMap(
            options={
                "1": dash_m.ValueMappingResult(text=true_text, color=true_color, index=0),
                "0": dash_m.ValueMappingResult(text=false_text, color=false_color, index=1),
            }
        )
    ]


def thresholds(*steps: tuple[float | None, str]) -> dash_b.ThresholdsConfig:
    return (
        dash_b.ThresholdsConfig()
        .mode(dash_m.ThresholdsMode.ABSOLUTE)
        .steps([dash_m.Threshold(value=v, color=c) for v, c in steps])
    )


def query(
    ref: str, expr: str, legend: str = "__auto", *, instant: bool = False, fmt: str | None = None
) -> prom_b.Dataquery:
    q = prom_b.Dataquery().ref_id(ref).expr(expr).datasource(DS).legend_format(legend)
    q = q.instant() if instant else q.range()
    if fmt == "table":
        q = q.format(prom_m.PromQueryFormat.TABLE)
    return q


# ---------------------------------------------------------------------------------------------- panels


class Ids:
    """Provisional panel ids; build_dashboard renumbers all panels in layout order."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> int:
        self.n += 1
        return self.n


def _common(panel, ids: Ids, title: str, description: str, unit: str, w: int, h: int, targets):
    panel = panel.id(ids()).title(title).description(description).datasource(DS).unit(unit).span(w).height(h)
    for t in targets:
        panel = panel.with_target(t)
    return panel


def stat_panel(ids, title, description, unit, w, h, targets, steps, **kw):
    p = _common(stat.Panel(), ids, title, description, unit, w, h, targets)
    p = (
        p.thresholds(thresholds(*steps))
        .color_mode(common_m.BigValueColorMode.BACKGROUND)
        .graph_mode(common_m.BigValueGraphMode.NONE)
        .text_mode(common_m.BigValueTextMode.VALUE_AND_NAME)
        .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )
    if "mappings" in kw:
        p = p.mappings(kw["mappings"])
    return p


def series_panel(ids, title, description, unit, w, h, targets, *, bars=False, stacked=False, mappings=None):
    p = _common(timeseries.Panel(), ids, title, description, unit, w, h, targets)
    if any(RATE in t.build().expr for t in targets):
        p = p.interval(PROBE_PERIOD)
    p = p.legend(
        common_b.VizLegendOptions()
        .display_mode(common_m.LegendDisplayMode.LIST)
        .placement(common_m.LegendPlacement.BOTTOM)
        .show_legend(True)
    ).tooltip(
        common_b.VizTooltipOptions()
        .mode(common_m.TooltipDisplayMode.MULTI)
        .sort(common_m.SortOrder.DESCENDING)
    )
    if bars:
        p = p.draw_style(common_m.GraphDrawStyle.BARS).fill_opacity(60).line_width(1)
    else:
        p = (
            p.draw_style(common_m.GraphDrawStyle.LINE)
            .fill_opacity(10)
            .line_width(1)
            .show_points(common_m.VisibilityMode.AUTO)
        )
    if stacked:
        p = p.stacking(common_b.StackingConfig().mode(common_m.StackingMode.NORMAL))
    if mappings:
        p = p.mappings(mappings)
    return p


def timeline_panel(ids, title, description, w, h, targets, mappings, unit="none"):
    p = _common(statetimeline.Panel(), ids, title, description, unit, w, h, targets)
    return (
        p.mappings(mappings)
        .show_value(common_m.VisibilityMode.NEVER)
        .merge_values(True)
        .row_height(0.8)
        .fill_opacity(80)
        .line_width(0)
        .color_scheme(dash_b.FieldColor().mode(dash_m.FieldColorModeId.THRESHOLDS))
        .thresholds(thresholds((None, "text")))
        .legend(
            common_b.VizLegendOptions().show_legend(False).display_mode(common_m.LegendDisplayMode.HIDDEN)
        )
    )


def table_panel(
    ids, title, description, w, h, targets, transformations, unit="none", mappings=None, cell_background=False
):
    p = _common(table.Panel(), ids, title, description, unit, w, h, targets)
    for t in transformations:
        p = p.with_transformation(t)
    if mappings:
        p = p.mappings(mappings)
    if cell_background:
        p = p.cell_options(common_m.TableColoredBackgroundCellOptions()).align(
            common_m.FieldTextAlignment.CENTER
        )
    return p


def organize(exclude: list[str], rename: dict[str, str] | None = None) -> dash_m.DataTransformerConfig:
    return dash_m.DataTransformerConfig(
        id_val="organize",
        options={"excludeByName": dict.fromkeys(exclude, True), "renameByName": rename or {}},
    )


# ---------------------------------------------------------------------------------------------- dashboard


def variables() -> list:
    def qvar(name: str, label: str, q: str, description: str) -> dash_b.QueryVariable:
        return (
            dash_b.QueryVariable(name)
            .label(label)
            .description(description)
            .datasource(DS)
            .query(q)
            .multi(True)
            .include_all(True)
            .all_value(".+")
            .refresh(dash_m.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(dash_m.VariableSort.ALPHABETICAL_ASC)
        )

    return [
        dash_b.DatasourceVariable("datasource").label("Data source").type("prometheus"),
        qvar("job", "Job", f"label_values({N.build_info}, job)", "Prometheus job(s) scraping canaryd."),
        qvar(
            "instance",
            "Instance",
            f'label_values({N.build_info}{{job=~"$job"}}, instance)',
            "canaryd instance(s).",
        ),
        qvar(
            "backend",
            "Backend",
            f"label_values({N.verdict}{{{JOB}}}, backend)",
            "Serving backends (from canaryd's config).",
        ),
        qvar(
            "canary",
            "Canary",
            f'label_values({N.verdict}{{job=~"$job", instance=~"$instance", backend=~"$backend"}}, canary)',
            "Canary prompts.",
        ),
    ]


def fleet_row(ids: Ids) -> list:
    """The fleet at a glance: reachable backends, drifting canaries, regressions, probe success, stack
    changes, the oldest probe."""
    drifting = sel("verdict", f'verdict=~"{"|".join(DRIFT_VERDICTS)}"')
    regressions = sel("verdict", 'verdict="regression"')
    return [
        stat_panel(
            ids,
            "Backends reachable",
            f"Backends whose last stack snapshot reached them ({N.reachable}), out of all the "
            "backends canaryd probes.",
            "short",
            4,
            4,
            [
                query(
                    "A",
                    f"sum(max by (backend) ({S.reachable}))",
                    "reachable",
                    instant=True,
                ),
                query(
                    "B",
                    f"count(max by (backend) ({S.reachable}))",
                    "configured",
                    instant=True,
                ),
            ],
            [(None, "blue")],
        ),
        stat_panel(
            ids,
            "Canaries drifting",
            "Backend × canary pairs whose last verdict is a drift: " + ", ".join(DRIFT_VERDICTS) + ".",
            "short",
            4,
            4,
            [
                query(
                    "A",
                    f"sum(max by (backend, canary) ({drifting})) or vector(0)",
                    "drifting",
                    instant=True,
                )
            ],
            [(None, "green"), (1, "orange")],
        ),
        stat_panel(
            ids,
            "Regressions",
            "Backend × canary pairs whose last verdict is a regression: the baseline answered correctly, "
            "the last probe did not.",
            "short",
            4,
            4,
            [
                query(
                    "A",
                    f"sum(max by (backend, canary) ({regressions})) or vector(0)",
                    "regressions",
                    instant=True,
                )
            ],
            [(None, "green"), (1, "red")],
        ),
        stat_panel(
            ids,
            "Probe success ratio",
            "Share of the time range in which each canary's last probe had a usable answer "
            f"({N.success} averaged over the range, then over canaries).",
            "percentunit",
            4,
            4,
            [
                query(
                    "A",
                    f"avg(avg_over_time({S.success}[{RANGE}]))",
                    "success",
                    instant=True,
                )
            ],
            [(None, "red"), (0.9, "orange"), (0.99, "green")],
        ),
        stat_panel(
            ids,
            "Stack changes",
            "Times a backend's serving stack (engine version, model, fingerprint, …) changed between two "
            "probes, over the time range. Each one is also an annotation on the time series.",
            "short",
            4,
            4,
            [
                query(
                    "A",
                    f"sum(increase({S.stack_changes}[{RANGE}]))",
                    "changes",
                    instant=True,
                )
            ],
            [(None, "green"), (1, "purple")],
        ),
        stat_panel(
            ids,
            "Oldest probe",
            "Time since the least recent probe among the selected canaries: a large value means canaryd "
            "stopped probing (or a schedule is stuck).",
            "s",
            4,
            4,
            [
                query(
                    "A",
                    f"max(time() - {S.last_probe})",
                    "age",
                    instant=True,
                )
            ],
            [(None, "green"), (3600, "orange")],
        ),
    ]


def verdicts_row(ids: Ids) -> list:
    """The current verdict of every backend × canary, its history, and the count per verdict."""
    code = verdict_code_expr()
    return [
        table_panel(
            ids,
            "Verdict matrix",
            f"Current verdict per canary (rows) and backend (columns), from {N.verdict} == 1; "
            "most severe first: " + "; ".join(f"{v.value}: {v.meaning}" for v in Verdict) + ".",
            8,
            10,
            [query("A", code, instant=True, fmt="table")],
            [
                dash_m.DataTransformerConfig(
                    id_val="groupingToMatrix",
                    options={
                        "columnField": "backend",
                        "rowField": "canary",
                        "valueField": "Value",
                        "emptyValue": "null",
                    },
                )
            ],
            mappings=verdict_mappings(),
            cell_background=True,
        ),
        timeline_panel(
            ids,
            "Verdict history",
            "Verdict of every backend × canary over time (same colours as the matrix).",
            16,
            10,
            [query("A", code, "{{backend}} · {{canary}}")],
            verdict_mappings(),
        ),
        series_panel(
            ids,
            "Verdicts now",
            f"Backend × canary pairs by their current verdict, over time ({N.verdict} counted "
            "by verdict). Every verdict ever given is in the database: canaryd history.",
            "short",
            24,
            8,
            [query("A", f"count by (verdict) ({S.verdict})", "{{verdict}}")],
            bars=True,
            stacked=True,
        ),
    ]


def drift_row(ids: Ids) -> list:
    """How far the logprobs moved from the baseline."""
    return [
        series_panel(
            ids,
            "Max |Δ logprob| vs baseline",
            "Largest absolute logprob difference (natural log, nats) against the baseline over the "
            "common token prefix, chosen tokens and shared top-k alternatives "
            f"({N.delta}). 0 = bit-identical logprobs. Where the answers first "
            "diverge is in the database: canaryd history.",
            "suffix: nats",
            24,
            8,
            [
                query(
                    "A",
                    f"max by (backend, canary) ({S.delta})",
                    "{{backend}} · {{canary}}",
                )
            ],
        ),
    ]


def evidence_row(ids: Ids) -> list:
    """What the calibrated detector, the text basis and the reference say per backend."""
    return [
        series_panel(
            ids,
            "Drift evidence (e-CUSUM)",
            "The sequential evidence that a backend changed, over its calibrated canaries "
            f"({N.e_cusum}): about 1 or below while honest; the alarm is raised when it "
            "reaches [compare] arl. Only over calibrated canaries (learned, or by `canaryd baseline "
            "calibrate`).",
            "short",
            8,
            8,
            [query("A", f"max by (backend) ({S.e_cusum})", "{{backend}}")],
        ),
        timeline_panel(
            ids,
            "Drift alarm",
            f"Whether the calibrated evidence says the backend changed ({N.alarm}): set by "
            "min_out canaries beyond their noise in one cycle, an exact-regime change, or the e-CUSUM; "
            "cleared by recalibrating or accepting a baseline.",
            8,
            8,
            [query("A", f"max by (backend) ({S.alarm})", "{{backend}}")],
            bool_mappings("alarm", "quiet", false_color="green", true_color="red"),
        ),
        series_panel(
            ids,
            "Canaries judged on text",
            "Canaries whose last answer was judged on text alone, without logprobs "
            f"({N.text_basis}): their verdicts rest on text, usage and stack. A rise "
            "on a backend that had logprobs means it stopped returning them.",
            "short",
            8,
            8,
            [query("A", f"max by (backend) ({S.text_basis})", "{{backend}}")],
        ),
        series_panel(
            ids,
            "Canaries learning their noise",
            "Canaries (and chain steps) without a noise model yet, learning one from probes spread over "
            f"passes ({N.learning}): their moves are the verdict learning, never drift. It falls to 0 "
            "within [compare] learn_max_passes; one that stays up is in the runbook.",
            "short",
            8,
            6,
            [query("A", f"max by (backend) ({S.learning})", "{{backend}}")],
        ),
        series_panel(
            ids,
            "Reference divergence (nats)",
            "For a backend with a reference (the weights it claims, re-scored there by teacher forcing): the "
            "largest gap the reference puts between its answer and the reference's own where they part "
            f"({N.reference_divergence}). 0 while it serves the same weights; a 4- or "
            "8-bit build or another checkpoint lifts it (verdict reference-mismatch).",
            "short",
            16,
            6,
            [
                query(
                    "A",
                    f"max by (backend) ({S.reference_divergence})",
                    "{{backend}}",
                )
            ],
        ),
    ]


def probes_row(ids: Ids) -> list:
    """Probe latency, counts, failures and staleness."""
    return [
        series_panel(
            ids,
            "Probe latency",
            "p50 / p95 / p99 request latency of successful probes per backend, from the "
            f"{N.duration} histogram.",
            "s",
            8,
            8,
            [
                query(
                    ref,
                    f"histogram_quantile({q}, sum by (le, backend) "
                    f"(rate({sel('duration', suffix='_bucket')}[{RATE}])))",
                    f"p{round(q * 100)} {{{{backend}}}}",
                )
                for ref, q in (("A", 0.5), ("B", 0.95), ("C", 0.99))
            ],
        ),
        series_panel(
            ids,
            "Probes, retries and failures by reason",
            f"Probes sent ({N.probes}), failed probes by reason "
            f"({N.failures}) and retries ({N.retries}) per "
            'scrape interval. A backend without failures shows a zero line with reason "none".',
            "short",
            8,
            8,
            [
                query(
                    "A",
                    f"sum by (backend) (increase({S.probes}[{RATE}]))",
                    "{{backend}} probes",
                ),
                query(
                    "B",
                    f"sum by (backend, reason) "
                    f"(increase({S.failures}[{RATE}])) "
                    f"or on (backend) label_replace(sum by (backend) "
                    f"(0 * increase({S.probes}[{RATE}])), "
                    f'"reason", "none", "", "")',
                    "{{backend}} failed: {{reason}}",
                ),
                query(
                    "C",
                    f"sum by (backend) (increase({S.retries}[{RATE}])) "
                    f"or on (backend) sum by (backend) "
                    f"(0 * increase({S.probes}[{RATE}]))",
                    "{{backend}} retries",
                ),
            ],
            bars=True,
        ),
        series_panel(
            ids,
            "Time since last probe",
            f"Age of each canary's last probe ({N.last_probe}) next to its "
            f"backend's longest configured interval ({N.interval}). Age well "
            "above the interval = stale.",
            "s",
            8,
            8,
            [
                query(
                    "A",
                    f"max by (backend, canary) (time() - {S.last_probe})",
                    "{{backend}} · {{canary}}",
                ),
                query(
                    "B",
                    f"max by (backend) ({S.interval})",
                    "{{backend}} interval",
                ),
            ],
        ),
    ]


def stack_row(ids: Ids) -> list:
    """The serving stack each backend showed, and its changes."""
    return [
        table_panel(
            ids,
            "Current serving stack",
            f"What each backend showed last ({N.stack_info}): kind, engine version, "
            "system_fingerprint, model and canaryd's hash of the whole stack snapshot.",
            16,
            7,
            [
                query(
                    "A",
                    "max by (backend, kind, engine_version, fingerprint, model, stack_hash) "
                    f"({S.stack_info})",
                    instant=True,
                    fmt="table",
                )
            ],
            [organize(["Time", "Value"], {"engine_version": "engine version", "stack_hash": "stack hash"})],
        ),
        series_panel(
            ids,
            "Fingerprints and serving configurations",
            "Distinct system_fingerprint values and serving configurations (fingerprint, provider or "
            "deployment) a backend answered from within canaryd's fingerprint window "
            f"({N.fingerprints}, {N.configurations}), and configurations new to a "
            f"canary per interval ({N.new_configurations}). More than 1 configuration = "
            "a fleet or router serves the backend: each has its own baselines.",
            "short",
            8,
            7,
            [
                query(
                    "A",
                    f"max by (backend) ({S.fingerprints})",
                    "{{backend}} fingerprints",
                ),
                query(
                    "B",
                    f"max by (backend) ({S.configurations})",
                    "{{backend}} configurations",
                ),
                query(
                    "C",
                    f"sum by (backend) (increase({S.new_configurations}[{RATE}]))",
                    "{{backend}} new",
                ),
            ],
        ),
        timeline_panel(
            ids,
            "Stack history",
            "Which serving stack each backend ran over time: one row per backend, engine version, "
            f"fingerprint and stack hash ({N.stack_info}).",
            12,
            8,
            [
                query(
                    "A",
                    f"max by (backend, engine_version, fingerprint, stack_hash) ({S.stack_info})",
                    "{{backend}} {{engine_version}} {{fingerprint}} {{stack_hash}}",
                )
            ],
            [
                dash_m.ValueMap(
                    options={"1": dash_m.ValueMappingResult(text="active", color="purple", index=0)}
                )
            ],
        ),
        series_panel(
            ids,
            "Stack changes per interval",
            f"Stack changes detected per scrape interval ({N.stack_changes}).",
            "short",
            6,
            8,
            [
                query(
                    "A",
                    f"sum by (backend) (increase({S.stack_changes}[{RATE}]))",
                    "{{backend}}",
                )
            ],
            bars=True,
        ),
        timeline_panel(
            ids,
            "Backend reachable",
            f"Whether the last stack snapshot reached the backend ({N.reachable}).",
            6,
            8,
            [query("A", f"max by (backend) ({S.reachable})", "{{backend}}")],
            bool_mappings("up", "down"),
        ),
    ]


def cost_row(ids: Ids) -> list:
    """Tokens spent, canaries refused as configured, passes over budget."""
    return [
        series_panel(
            ids,
            "Tokens spent",
            f"Tokens the backends' answers reported ({N.tokens}: prompt + completion, "
            "reasoning included), per scrape interval; a rise per pass is a provider raising reasoning "
            "effort or a longer hidden prompt.",
            "short",
            12,
            7,
            [
                query(
                    "A",
                    f"sum by (backend) (increase({S.tokens}[{RATE}]))",
                    "{{backend}}",
                )
            ],
            bars=True,
        ),
        series_panel(
            ids,
            "Refused as configured",
            "Canaries each backend refused for a parameter or value it does not take "
            f"({N.config_errors}): held back until the config is reloaded; a configuration "
            "problem, not an outage (canaryd check names the fix).",
            "short",
            6,
            7,
            [query("A", f"max by (backend) ({S.config_errors})", "{{backend}}")],
        ),
        series_panel(
            ids,
            "Passes over budget",
            "Passes skipped because they would exceed the backend's daily token or request budget "
            f"({N.budget_skips}), per scrape interval.",
            "short",
            6,
            7,
            [
                query(
                    "A",
                    f"sum by (backend) (increase({S.budget_skips}[{RATE}]))",
                    "{{backend}}",
                )
            ],
            bars=True,
        ),
    ]


def canaryd_row(ids: Ids) -> list:
    """canaryd itself: schedules, reloads, build, leases."""
    return [
        series_panel(
            ids,
            "Schedule runs, missed runs and overruns",
            f"Scheduled probe passes started ({N.schedule_runs}), skipped because the "
            f"previous pass still ran or missed its grace time ({N.schedule_missed}), and longer than "
            f"their interval ({N.schedule_overruns}: the daemon carries too much), per scrape interval.",
            "short",
            10,
            7,
            [
                query(
                    "A",
                    f"sum by (schedule) (increase({S.schedule_runs}[{RATE}]))",
                    "{{schedule}} runs",
                ),
                query(
                    "B",
                    f"sum by (schedule) (increase({S.schedule_missed}[{RATE}])) "
                    f"or sum by (schedule) (0 * increase({S.schedule_runs}[{RATE}]))",
                    "{{schedule}} missed",
                ),
                query(
                    "C",
                    f"sum by (schedule) (increase({S.schedule_overruns}[{RATE}]))",
                    "{{schedule}} overran",
                ),
            ],
            bars=True,
        ),
        stat_panel(
            ids,
            "Since last scheduled pass",
            f"Time since the least recently finished schedule's last pass ({N.schedule_last}).",
            "s",
            4,
            7,
            [
                query(
                    "A",
                    f"max(time() - max by (schedule) ({S.schedule_last}))",
                    "age",
                    instant=True,
                )
            ],
            [(None, "green"), (3600, "orange")],
        ),
        stat_panel(
            ids,
            "Config reloads",
            "SIGHUP config reloads attempted and rejected over the time range (a rejected reload keeps "
            "the previous config running).",
            "short",
            4,
            7,
            [
                query(
                    "A",
                    f"sum(increase({S.reloads}[{RANGE}]))",
                    "reloads",
                    instant=True,
                ),
                query(
                    "B",
                    f"sum(increase({S.reload_failures}[{RANGE}]))",
                    "rejected",
                    instant=True,
                ),
            ],
            [(None, "blue")],
        ),
        table_panel(
            ids,
            "Build info",
            f"canaryd and Python versions per instance ({N.build_info}).",
            6,
            7,
            [
                query(
                    "A",
                    f"max by (instance, version, python_version) ({S.build_info})",
                    instant=True,
                    fmt="table",
                )
            ],
            [organize(["Time", "Value"], {"python_version": "python"})],
        ),
        timeline_panel(
            ids,
            "Lease holders",
            f"Which canaryd instance probes each backend ({N.lease_held}): in a fleet on one "
            "PostgreSQL database one daemon per backend, the others standing by to take over when it stops "
            "or dies; on SQLite a daemon probes all its backends.",
            24,
            6,
            [
                query(
                    "A",
                    f"max by (backend, instance) ({S.lease_held})",
                    "{{backend}} on {{instance}}",
                )
            ],
            bool_mappings("probing", "standby", false_color="blue"),
        ),
    ]


def daemons_row(ids: Ids) -> list:
    """A fleet's daemons on one PostgreSQL database: how the backends are shared (`canaryd fleet`)."""
    return [
        series_panel(
            ids,
            "Weighted share per daemon",
            f"Each daemon's share of the fleet's work ({N.fleet_share}): the backends whose leases it "
            "holds, each weighted by its canaries × passes per hour. Even shares are 1/N; a join or a "
            "leave moves them within an interval. 100 % on SQLite (a single daemon).",
            "percentunit",
            12,
            7,
            [query("A", f"max by (instance) ({S.fleet_share})", "{{instance}}")],
            stacked=True,
        ),
        series_panel(
            ids,
            "Backends held per daemon",
            f"Backends whose probing lease each daemon holds ({N.fleet_backends}).",
            "short",
            8,
            7,
            [query("A", f"max by (instance) ({S.fleet_backends})", "{{instance}}")],
        ),
        stat_panel(
            ids,
            "Live daemons",
            f"Live daemons of the fleet, as the daemons last counted them ({N.fleet_daemons}); fewer "
            "than you run means one stopped, hung or lost its database connection.",
            "short",
            4,
            7,
            [query("A", f"max({S.fleet_daemons})", "live", instant=True)],
            [(None, "blue")],
        ),
    ]


# The rows top to bottom: (title, its panels). The widths of each visual line of a row add up to 24 (the
# SDK lays them out left to right).
ROWS = (
    ("Fleet overview", fleet_row),
    ("Verdicts", verdicts_row),
    ("Drift", drift_row),
    ("Calibrated evidence", evidence_row),
    ("Probes", probes_row),
    ("Serving stack", stack_row),
    ("Cost and configuration", cost_row),
    ("Daemons", daemons_row),
    ("canaryd", canaryd_row),
)


def build_panels(ids: Ids) -> list[tuple[str, list]]:
    """Rows of panels, in `ROWS` order."""
    return [(title, row(ids)) for title, row in ROWS]


def stack_change_annotation() -> dash_b.AnnotationQuery:
    return (
        dash_b.AnnotationQuery()
        .name("Stack changes")
        .datasource(DS)
        .enable(True)
        .icon_color("purple")
        .expr(f"sum by (backend) (increase({S.stack_changes}[{RATE}])) > 0")
    )


def build_dashboard() -> dict:
    """The dashboard as a plain JSON-ready dict."""
    ids = Ids()
    d = (
        dash_b.Dashboard(TITLE)
        .uid(UID)
        .description(
            "Known-answer canaries against LLM serving backends: verdicts, logprob drift, serving-stack "
            "changes. Generated by grafana/build_dashboard.py."
        )
        .tags(["canaryd"])
        .readonly()
        .tooltip(dash_m.DashboardCursorSync.CROSSHAIR)
        .time("now-6h", "now")
        .refresh("1m")
        .link(
            dash_b.DashboardLink("canaryd")
            .type(dash_m.DashboardLinkType.DASHBOARDS)
            .tags(["canaryd"])
            .as_dropdown(True)
            .include_vars(True)
            .keep_time(True)
        )
        .annotation(stack_change_annotation())
    )
    for v in variables():
        d = d.with_variable(v)
    for row_title, panels in build_panels(ids):
        d = d.with_row(dash_b.Row(row_title).id(ids()))
        for p in panels:
            d = d.with_panel(p)
    out = json.loads(json.dumps(d.build(), cls=JSONEncoder))
    # What the SDK's builders don't express.
    out["id"] = None  # the database assigns it; provisioning and import match on uid
    for i, p in enumerate(out["panels"], 1):
        p["id"] = i  # in layout order, rows included
    for v in out["templating"]["list"]:
        if v["type"] == "datasource":
            v.update(current={}, refresh=1, hide=0)  # {} → Grafana picks the default Prometheus
    for a in out["annotations"]["list"]:
        a.update(
            step="60s",
            titleFormat="Stack change: {{backend}}",
            textFormat="serving stack of {{backend}} changed between two probes",
            tagKeys="backend",
            useValueForTime=False,
        )
    out["annotations"]["list"].insert(
        0,
        {
            "builtIn": 1,
            "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True,
            "hide": True,
            "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts",
            "type": "dashboard",
        },
    )
    return out


def render() -> str:
    return json.dumps(build_dashboard(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


# ---------------------------------------------------------------------------------------------- queries out

_VAR = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")


def all_panels(dashboard: dict) -> list[dict]:
    """Every panel, rows' nested panels included (rows themselves excluded)."""
    out = []
    for p in dashboard.get("panels", []):
        if p.get("type") == "row":
            out.extend(p.get("panels", []))
        else:
            out.append(p)
    return out


def substitute(expr: str, dashboard: dict, variables: dict[str, str] | None = None) -> str:
    """Replace Grafana template variables in ``expr`` like Grafana would.

    ``variables`` maps names (``backend``, ``__rate_interval``, with or without ``$``) to the text to insert;
    values go in verbatim, so a multi-value selection is a regex such as ``(a|b)``. Unset built-ins use
    BUILTIN_DEFAULTS; unset query variables use their ``allValue`` (``.+``, what Grafana's "All" inserts).
    An unknown variable raises KeyError.
    """
    given = {k.lstrip("$"): v for k, v in (variables or {}).items()}
    alls = {
        v["name"]: v.get("allValue") or ".*"
        for v in dashboard.get("templating", {}).get("list", [])
        if v.get("type") == "query"
    }

    def repl(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        for table_ in (given, BUILTIN_DEFAULTS, alls):
            if name in table_:
                return table_[name]
        raise KeyError(f"unknown template variable ${name} in {expr!r}")

    return _VAR.sub(repl, expr)


def panel_queries(dashboard: dict, variables: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every panel target and every Prometheus annotation, variables substituted.

    Annotations are titled ``"annotation: <name>"``. See :func:`substitute` for ``variables``.
    """
    out = []
    for p in all_panels(dashboard):
        for t in p.get("targets", []):
            if t.get("expr") and not t.get("hide"):
                out.append((p["title"], substitute(t["expr"], dashboard, variables)))
    for a in dashboard.get("annotations", {}).get("list", []):
        if a.get("expr"):
            out.append((f"annotation: {a['name']}", substitute(a["expr"], dashboard, variables)))
    return out


def variable_queries(dashboard: dict, variables: dict[str, str] | None = None) -> list[tuple[str, str, str]]:
    """(variable name, series selector, label) for every ``label_values(selector, label)`` query variable."""
    out = []
    for v in dashboard.get("templating", {}).get("list", []):
        q = v.get("query")
        if v.get("type") == "query" and isinstance(q, str):
            m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", q.strip())
            if m:
                out.append((v["name"], substitute(m.group(1), dashboard, variables), m.group(2)))
    return out


# ---------------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the JSON on disk is stale; write nothing")
    ap.add_argument("--output", type=Path, default=OUTPUT, help=f"default: {OUTPUT}")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            diff = difflib.unified_diff(
                current.splitlines(), text.splitlines(), str(args.output), "generated", lineterm="", n=1
            )
            print("\n".join(list(diff)[:60]), file=sys.stderr)
            print(f"{args.output} is stale: run python grafana/build_dashboard.py", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
