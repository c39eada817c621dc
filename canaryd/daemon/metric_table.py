"""Every series canaryd exports, declared once: `Metrics` creates them from this table, removes a backend's
from it (a reload that drops the backend, a lease lost to another daemon), the exposition renders the
per-pair families from it, and the dashboard and alert-rule builders select series by it.

Standard library only, so that the builders under ``grafana/`` and ``prometheus/`` import it cheaply.

A new metric is one row here (plus the code that sets it, and a dashboard panel if it should be drawn).
The row's order is its place in the exposition.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal


class Scope(enum.Enum):
    """Where a series lives, which is when it is rendered."""

    LIVE = "live"  # canaryd's own (schedules, reloads, build): rendered on every scrape
    PASS = "pass"  # per backend: rendered at most once per probe pass (`Metrics.publish`)
    PAIR = "pair"  # per canary × backend: rendered by hand with the pass (`exposition.render_pairs`)


class LeaseLoss(enum.Enum):
    """What a backend's series does when another daemon takes the backend's lease."""

    KEEP = "keep"  # stays: a count so far, a setting (the interval), or the lease itself (set to 0)
    DROP = "drop"  # goes: a state the holder now reports, which this daemon would only let age


@dataclass(frozen=True)
class MetricDef:
    """One family. ``attr``: the attribute of `Metrics` holding it, or for a pair family the attribute
    of `exposition.Pair`. ``name``: the family name, without the ``_total`` a counter's samples add."""

    attr: str
    name: str
    type: Literal["counter", "gauge", "histogram"]
    help: str
    labels: tuple[str, ...]
    scope: Scope
    lease_loss: LeaseLoss | None = None  # every per-backend row says, and only those
    buckets: tuple[float, ...] = ()  # a histogram's
    drawn: bool = True  # False: no dashboard panel queries it (tests/unit/test_dashboard.py checks both ways)

    def __post_init__(self) -> None:
        if self.per_backend != (self.lease_loss is not None):
            raise ValueError(f"{self.name}: a per-backend series says what a lost lease does to it, no other")

    @property
    def per_backend(self) -> bool:
        """Removed with its backend (a reload that drops it); on a lost lease, as ``lease_loss`` says."""
        return "backend" in self.labels

    @property
    def sample(self) -> str:
        """The name PromQL selects it by: a counter's samples end in ``_total``; a histogram's in
        ``_bucket``, ``_sum`` and ``_count`` (append one)."""
        return self.name + "_total" if self.type == "counter" else self.name


# Shorthands for the rows.
S, B, P = ("schedule",), ("backend",), ("backend", "canary")
LIVE, PASS, PAIR = Scope.LIVE, Scope.PASS, Scope.PAIR
KEEP, DROP = LeaseLoss.KEEP, LeaseLoss.DROP
PROBE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

METRICS: tuple[MetricDef, ...] = (
    # -- canaryd's own --------------------------------------------------------------------------------
    MetricDef(
        "schedule_runs", "canaryd_schedule_runs", "counter", "Scheduled probe passes started.", S, LIVE
    ),
    MetricDef(
        "schedule_missed",
        "canaryd_schedule_missed",
        "counter",
        "Scheduled passes skipped: still running, or missed their grace time.",
        S,
        LIVE,
    ),
    MetricDef(
        "schedule_last",
        "canaryd_schedule_last_run_timestamp_seconds",
        "gauge",
        "Unix time the last pass of this schedule finished.",
        S,
        LIVE,
    ),
    MetricDef(
        "schedule_duration",
        "canaryd_schedule_last_pass_duration_seconds",
        "gauge",
        "Seconds the last pass of this schedule took, start to finish (compare with its interval).",
        S,
        LIVE,
        drawn=False,
    ),
    MetricDef(
        "schedule_overruns",
        "canaryd_schedule_overruns",
        "counter",
        "Passes of this schedule that took longer than its interval: the daemon carries too much.",
        S,
        LIVE,
    ),
    MetricDef(
        "schedule_respaced",
        "canaryd_schedule_respaced",
        "counter",
        "Backends a pass of this schedule left because their last probe (a takeover's, a previous holder's) "
        "was less than their spacing ago: each is probed on that probe's phase instead.",
        S,
        LIVE,
        drawn=False,
    ),
    MetricDef(
        "requests_in_flight",
        "canaryd_requests_in_flight",
        "gauge",
        "Requests to backends in flight now, across all backends (at most [daemon] max_in_flight).",
        (),
        LIVE,
        drawn=False,
    ),
    MetricDef("reloads", "canaryd_config_reloads", "counter", "Config reloads attempted (SIGHUP).", (), LIVE),
    MetricDef(
        "reload_failures",
        "canaryd_config_reload_failures",
        "counter",
        "Config reloads rejected; the previous config kept running.",
        (),
        LIVE,
    ),
    MetricDef(
        "build_info", "canaryd_build_info", "gauge", "canaryd's version.", ("version", "python_version"), LIVE
    ),
    MetricDef(
        "fleet_daemons",
        "canaryd_fleet_daemons_live",
        "gauge",
        "Live daemons of the fleet sharing this daemon's database, at its last claim (1 on SQLite).",
        (),
        LIVE,
    ),
    MetricDef(
        "fleet_backends",
        "canaryd_fleet_backends_held",
        "gauge",
        "Backends whose probing lease this daemon holds.",
        (),
        LIVE,
    ),
    MetricDef(
        "fleet_share",
        "canaryd_fleet_weight_share",
        "gauge",
        "This daemon's share (0 to 1) of the fleet's work: the backends it holds, each weighted by its "
        "canaries × passes per hour.",
        (),
        LIVE,
    ),
    # -- per backend ----------------------------------------------------------------------------------
    MetricDef(
        "duration",
        "canaryd_backend_probe_duration_seconds",
        "histogram",
        "Request latency of the canary probes that got an answer, per backend.",
        B,
        PASS,
        KEEP,
        buckets=PROBE_BUCKETS,
    ),
    MetricDef(
        "interval",
        "canaryd_backend_probe_interval_seconds",
        "gauge",
        "Longest configured interval between probes of the backend's canaries (staleness alerts).",
        B,
        PASS,
        KEEP,
    ),
    MetricDef("probes", "canaryd_backend_probes", "counter", "Canary probes sent.", B, PASS, KEEP),
    MetricDef(
        "retries",
        "canaryd_backend_probe_retries",
        "counter",
        "Extra attempts after transient failures.",
        B,
        PASS,
        KEEP,
    ),
    MetricDef(
        "failures",
        "canaryd_backend_probe_failures",
        "counter",
        "Canary probes that failed, by reason.",
        (*B, "reason"),
        PASS,
        KEEP,
    ),
    MetricDef(
        "stack_info",
        "canaryd_backend_stack_info",
        "gauge",
        "The serving stack a backend showed last.",
        ("backend", "kind", "engine_version", "fingerprint", "model", "stack_hash"),
        PASS,
        DROP,
    ),
    MetricDef(
        "stack_changes",
        "canaryd_backend_stack_changes",
        "counter",
        "Times a backend's stack snapshot differed from the previous probe's.",
        B,
        PASS,
        KEEP,
    ),
    MetricDef(
        "fingerprints",
        "canaryd_backend_fingerprints",
        "gauge",
        "Distinct system_fingerprint values seen in the fingerprint window.",
        B,
        PASS,
        DROP,
    ),
    MetricDef(
        "configurations",
        "canaryd_backend_configurations",
        "gauge",
        "Distinct serving configurations (fingerprint, provider, deployment) the backend answered from "
        "in the fingerprint window; 0 when its answers name none.",
        B,
        PASS,
        DROP,
    ),
    MetricDef(
        "new_configurations",
        "canaryd_backend_new_configurations",
        "counter",
        "Probes whose serving configuration was new to their canary (verdict new-configuration).",
        B,
        PASS,
        KEEP,
    ),
    MetricDef(
        "e_cusum",
        "canaryd_backend_drift_evidence",
        "gauge",
        "e-CUSUM statistic over the calibrated canaries; reaching the arl raises the alarm.",
        B,
        PASS,
        DROP,
    ),
    MetricDef(
        "alarm",
        "canaryd_backend_drift_alarm",
        "gauge",
        "1 once the backend's calibrated evidence says it changed, until recalibrated or accepted.",
        B,
        PASS,
        DROP,
    ),
    MetricDef(
        "reference_divergence",
        "canaryd_backend_reference_divergence_nats",
        "gauge",
        "Largest gap (nats) its reference puts between the backend's answer and its own where they part, "
        "over the last pass: 0 while both answer alike (only for a backend with a reference).",
        B,
        PASS,
        DROP,
    ),
    MetricDef(
        "text_basis",
        "canaryd_backend_text_basis_canaries",
        "gauge",
        "Canaries whose last answer was judged on text alone (no logprobs on it or its baseline).",
        B,
        PASS,
        DROP,
    ),
    MetricDef(
        "learning",
        "canaryd_backend_learning_canaries",
        "gauge",
        "Canaries (and chain steps) still learning their noise model ([compare] learn): their answers "
        "moving is the verdict learning, never drift, until the model is fit.",
        B,
        PASS,
        DROP,
    ),
    MetricDef(
        "reachable",
        "canaryd_backend_reachable",
        "gauge",
        "1 if the last stack snapshot reached the backend, else 0.",
        B,
        PASS,
        DROP,
    ),
    MetricDef(
        "lease_held",
        "canaryd_backend_lease_held",
        "gauge",
        "1 if this daemon holds the backend's probing lease, 0 if another daemon does.",
        B,
        PASS,
        KEEP,
    ),
    MetricDef(
        "config_errors",
        "canaryd_backend_config_errors",
        "gauge",
        "Canaries the backend refused as configured (an unsupported parameter or value): not sent "
        "again until the config is reloaded.",
        B,
        PASS,
        DROP,
    ),
    MetricDef(
        "tokens",
        "canaryd_backend_tokens",
        "counter",
        "Tokens the backend's answers reported (prompt + completion; reasoning counts in completion).",
        B,
        PASS,
        KEEP,
    ),
    MetricDef(
        "budget_skips",
        "canaryd_backend_budget_skips",
        "counter",
        "Passes of the backend skipped because they would exceed its daily token or request budget.",
        B,
        PASS,
        KEEP,
    ),
    # -- per canary × backend: canaryd_canary_verdict carries the current verdict as a label, one series
    # per pair (value 1), so alerts and panels select it by name --------------------------------------
    MetricDef(
        "verdict",
        "canaryd_canary_verdict",
        "gauge",
        "The verdict of the last probe (one series per canary, value 1).",
        (*P, "verdict"),
        PAIR,
        DROP,
    ),
    MetricDef(
        "success",
        "canaryd_canary_probe_success",
        "gauge",
        "1 if the last probe got a usable answer, else 0.",
        P,
        PAIR,
        DROP,
    ),
    MetricDef(
        "delta",
        "canaryd_canary_logprob_delta_max",
        "gauge",
        "Largest |delta logprob| against the baseline over the common token prefix "
        "(chosen tokens and shared top-k alternatives) in the last usable answer.",
        P,
        PAIR,
        DROP,
    ),
    MetricDef(
        "last_probe",
        "canaryd_canary_last_probe_timestamp_seconds",
        "gauge",
        "Unix time of the last probe of this canary.",
        P,
        PAIR,
        DROP,
    ),
)

BY_ATTR = {m.attr: m for m in METRICS}
PAIR_FAMILIES = tuple(m for m in METRICS if m.scope is PAIR)
