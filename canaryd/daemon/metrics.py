"""Prometheus metrics: what the last probe of every canary × backend said, and the stacks behind them.

canaryd is directly instrumented (it probes on its own schedule; a scrape never triggers a probe).
Labels are bounded: ``backend`` and ``canary`` come from the config, ``verdict`` and ``reason`` are
enums, and free text (answers, errors, prompts) never becomes a label. The stack ``_info`` series carries
the few identity strings a dashboard needs (engine version, fingerprint, model, stack hash), one series
per backend at a time, each cut to ``label_length`` characters (`bounded`: a server's 1 MB fingerprint is
a label of 128; the full value stays in the database).
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections import deque
from collections.abc import Iterable
from importlib.metadata import version as dist_version

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)

from canaryd.backends import engine_version
from canaryd.judge.compare import Verdict
from canaryd.judge.stats import DetectorState
from canaryd.observation import ErrorKind, storable
from canaryd.probe.run import BackendRun

PROBE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
MARK = "…"  # where a label value too long for its series was cut
HASH_CHARS = 10  # hex digits of the whole value's hash kept after the mark: two long values stay distinct


def _digest(value: str) -> str:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()


def bounded(value: str, limit: int) -> str:
    """``value`` as a label value of at most ``limit`` characters (limit ≥ 16): a longer one is cut to its
    first characters (three quarters of the limit at most), the mark and a hash of the whole value. Text
    UTF-8 cannot encode is escaped, so one odd value can never break the exposition."""
    value = storable(value)
    if len(value) <= limit:
        return value
    head = max(0, min(limit * 3 // 4, limit - len(MARK) - HASH_CHARS))
    return value[:head] + MARK + _digest(value)[:HASH_CHARS]


class Metrics:
    """Every series canaryd exports, on a registry of its own (no global state)."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        fingerprint_window_s: float = 3600.0,
        label_length: int = 128,
    ) -> None:
        disable_created_metrics()  # the *_created series double the output and no alert or panel needs them
        self.registry = r = registry or CollectorRegistry()
        ProcessCollector(registry=r)  # process_resident_memory_bytes & co: watch the watcher
        PlatformCollector(registry=r)
        self.fingerprint_window_s = fingerprint_window_s
        self.label_length = label_length
        bc = ("backend", "canary")
        self.verdict = Gauge(
            "canaryd_canary_verdict",
            "1 for the verdict of the last probe, 0 for the others.",
            (*bc, "verdict"),
            registry=r,
        )
        self.correct = Gauge(
            "canaryd_canary_correct",
            "1 if the last answer matched the expected answer, else 0.",
            bc,
            registry=r,
        )
        self.text_match = Gauge(
            "canaryd_canary_text_match",
            "1 if the last answer's text equals the baseline's, else 0.",
            bc,
            registry=r,
        )
        self.logprob_delta = Gauge(
            "canaryd_canary_logprob_delta_max",
            "Largest |delta logprob| against the baseline over the common token prefix "
            "(chosen tokens and shared top-k alternatives).",
            bc,
            registry=r,
        )
        self.divergence = Gauge(
            "canaryd_canary_first_divergence_index",
            "Token index where the last answer first differs from the baseline; -1 if none.",
            bc,
            registry=r,
        )
        self.success = Gauge(
            "canaryd_canary_probe_success", "1 if the last probe got a usable answer, else 0.", bc, registry=r
        )
        self.duration = Histogram(
            "canaryd_canary_probe_duration_seconds",
            "Request latency of canary probes.",
            bc,
            buckets=PROBE_BUCKETS,
            registry=r,
        )
        self.last_probe = Gauge(
            "canaryd_canary_last_probe_timestamp_seconds",
            "Unix time of the last probe of this canary.",
            bc,
            registry=r,
        )
        self.interval = Gauge(
            "canaryd_canary_probe_interval_seconds",
            "Configured interval between probes of this canary (for staleness alerts).",
            bc,
            registry=r,
        )
        self.probes = Counter("canaryd_canary_probes", "Probes sent.", bc, registry=r)
        self.retries = Counter(
            "canaryd_canary_probe_retries", "Extra attempts after transient failures.", bc, registry=r
        )
        self.failures = Counter(
            "canaryd_canary_probe_failures", "Probes that failed, by reason.", (*bc, "reason"), registry=r
        )
        self.verdicts = Counter(
            "canaryd_canary_verdicts", "Verdicts given, by verdict.", (*bc, "verdict"), registry=r
        )
        self.stack_info = Gauge(
            "canaryd_backend_stack_info",
            "The serving stack a backend showed last.",
            ("backend", "kind", "engine_version", "fingerprint", "model", "stack_hash"),
            registry=r,
        )
        self.stack_changes = Counter(
            "canaryd_backend_stack_changes",
            "Times a backend's stack snapshot differed from the previous probe's.",
            ("backend",),
            registry=r,
        )
        self.fingerprints = Gauge(
            "canaryd_backend_fingerprints",
            "Distinct system_fingerprint values seen in the fingerprint window.",
            ("backend",),
            registry=r,
        )
        self.pvalue = Gauge(
            "canaryd_canary_noise_pvalue",
            "p-value of the last probe under the canary's calibrated noise (1: like an honest probe).",
            bc,
            registry=r,
        )
        self.e_cusum = Gauge(
            "canaryd_backend_drift_evidence",
            "e-CUSUM statistic over the calibrated canaries; reaching the configured arl raises the alarm.",
            ("backend",),
            registry=r,
        )
        self.alarm = Gauge(
            "canaryd_backend_drift_alarm",
            "1 once the backend's calibrated evidence says it changed, until recalibrated or accepted.",
            ("backend",),
            registry=r,
        )
        self.reachable = Gauge(
            "canaryd_backend_reachable",
            "1 if the last stack snapshot reached the backend, else 0.",
            ("backend",),
            registry=r,
        )
        self.lease_held = Gauge(
            "canaryd_backend_lease_held",
            "1 if this daemon probes the backend (holds its lease in a fleet; always on SQLite), else 0.",
            ("backend",),
            registry=r,
        )
        self.schedule_runs = Counter(
            "canaryd_schedule_runs", "Scheduled probe passes started.", ("schedule",), registry=r
        )
        self.schedule_missed = Counter(
            "canaryd_schedule_missed",
            "Scheduled passes skipped: still running, or missed their grace time.",
            ("schedule",),
            registry=r,
        )
        self.schedule_last = Gauge(
            "canaryd_schedule_last_run_timestamp_seconds",
            "Unix time the last pass of this schedule finished.",
            ("schedule",),
            registry=r,
        )
        self.reloads = Counter("canaryd_config_reloads", "Config reloads attempted (SIGHUP).", registry=r)
        self.reload_failures = Counter(
            "canaryd_config_reload_failures",
            "Config reloads rejected; the previous config kept running.",
            registry=r,
        )
        self.build_info = Gauge(
            "canaryd_build_info", "canaryd's version.", ("version", "python_version"), registry=r
        )
        self.build_info.labels(dist_version("canaryd"), sys.version.split()[0]).set(1)
        self._per_canary = (
            self.verdict,
            self.correct,
            self.text_match,
            self.logprob_delta,
            self.divergence,
            self.success,
            self.duration,
            self.last_probe,
            self.interval,
            self.probes,
            self.retries,
            self.failures,
            self.verdicts,
            self.pvalue,
        )
        self._per_backend = (
            self.stack_info,
            self.stack_changes,
            self.fingerprints,
            self.reachable,
            self.e_cusum,
            self.alarm,
            self.lease_held,
        )
        self._seen: set[tuple[str, str]] = set()
        self._stack_labels: dict[str, tuple[str, ...]] = {}
        self._stack_hash: dict[str, str] = {}
        self._fingerprints: dict[str, deque[tuple[float, str]]] = {}

    def set_intervals(self, intervals: Iterable[tuple[str, str, float]]) -> None:
        """Expected seconds between probes; canaries × backends not listed any more lose their series."""
        intervals = list(intervals)
        keep = {(b, c) for b, c, _ in intervals}
        for b, c in self._seen - keep:
            for m in self._per_canary:
                m.remove_by_labels({"backend": b, "canary": c})
        for b in {b for b, _ in self._seen} - {b for b, _ in keep}:
            for m in self._per_backend:
                m.remove_by_labels({"backend": b})
            self._stack_labels.pop(b, None)
            self._stack_hash.pop(b, None)
            self._fingerprints.pop(b, None)
        self._seen = keep
        for backend, canary, seconds in intervals:
            self.interval.labels(backend, canary).set(seconds)

    def set_lease(self, backend: str, held: bool) -> None:
        """Whether this daemon probes ``backend`` (its fleet lease). One that does not drops the backend's
        gauges, so that neither a verdict it no longer renews nor an ageing last-probe time stands for the
        backend (the holder exports them); its counters and intervals stay."""
        if not held:
            for m in (*self._per_canary, *self._per_backend):
                if isinstance(m, Gauge) and m is not self.interval:
                    m.remove_by_labels({"backend": backend})
            self._stack_labels.pop(backend, None)
            self._stack_hash.pop(backend, None)
            self._fingerprints.pop(backend, None)
        self.lease_held.labels(backend).set(1 if held else 0)

    def record_failed(
        self, backend: str, canary_ids: Iterable[str], reason: ErrorKind = ErrorKind.INTERNAL
    ) -> None:
        """A backend's pass that produced no results to record (canaryd failed at it): each canary's last
        probe is a failure of ``reason``, so the failing-probes alert sees it like any other failure. The
        last-probe times stay: nothing was recorded, and the staleness alert should see that too."""
        for c in canary_ids:
            for v in Verdict:
                self.verdict.labels(backend, c, v.value).set(1 if v is Verdict.ERROR else 0)
            self.verdicts.labels(backend, c, Verdict.ERROR.value).inc()
            self.success.labels(backend, c).set(0)
            self.failures.labels(backend, c, reason.value).inc()

    def record(self, run: BackendRun, now: float | None = None) -> None:
        """Fold one backend's probe pass into the series."""
        now = time.time() if now is None else now
        b = run.backend
        stopped = ErrorKind.STOPPED  # not sent because canaryd was stopping: says nothing of the backend
        if run.unavailable is None or run.unavailable.kind is not stopped:
            self.reachable.labels(b).set(0 if run.unavailable else 1)
        for res in run.results:
            obs, cmp = res.observation, res.comparison
            if obs.error_kind is stopped:
                continue
            c = obs.canary_id
            for v in Verdict:
                self.verdict.labels(b, c, v.value).set(1 if v is cmp.verdict else 0)
            self.verdicts.labels(b, c, cmp.verdict.value).inc()
            self.probes.labels(b, c).inc()
            if obs.attempts > 1:
                self.retries.labels(b, c).inc(obs.attempts - 1)
            self.last_probe.labels(b, c).set(now)
            self.success.labels(b, c).set(1 if obs.ok else 0)
            if not obs.ok:
                self.failures.labels(b, c, (obs.error_kind or ErrorKind.INTERNAL).value).inc()
                continue
            self.duration.labels(b, c).observe(obs.latency_s)
            if cmp.correct is not None:
                self.correct.labels(b, c).set(1 if cmp.correct else 0)
            if cmp.text_identical is not None:
                self.text_match.labels(b, c).set(1 if cmp.text_identical else 0)
            d = cmp.delta
            if d is not None:
                self.divergence.labels(b, c).set(-1 if d.first_divergence is None else d.first_divergence)
                self.logprob_delta.labels(b, c).set(max(d.max_abs_dlogprob or 0.0, d.max_abs_dtop or 0.0))
            elif cmp.verdict is Verdict.BASELINE:
                self.divergence.labels(b, c).set(-1)
                self.logprob_delta.labels(b, c).set(0)
            if cmp.evidence is not None and cmp.evidence.p_value is not None:
                self.pvalue.labels(b, c).set(cmp.evidence.p_value)
            if obs.system_fingerprint:  # by digest: a window of 1 MB fingerprints must not fill memory
                self._fingerprints.setdefault(b, deque()).append((now, _digest(obs.system_fingerprint)))
        if not run.unavailable:  # an unreachable backend keeps its last evidence
            state = run.detector or DetectorState()
            self.e_cusum.labels(b).set(state.statistic)
            self.alarm.labels(b).set(1 if state.alarm else 0)
        self._record_stack(run, now)

    def _record_stack(self, run: BackendRun, now: float) -> None:
        b = run.backend
        # The window is elapsed time. A stamp ahead of ``now`` (the wall clock went back) counts as seen
        # now: it ages out a window from here, not when the clock catches up with it, and it cannot hold
        # the stamps behind it in the window (nor grow it) meanwhile.
        cutoff = now - self.fingerprint_window_s
        seen = deque((min(t, now), fp) for t, fp in self._fingerprints.get(b, ()) if t >= cutoff)
        self._fingerprints[b] = seen
        self.fingerprints.labels(b).set(len({fp for _, fp in seen}))
        if run.unavailable or not run.stack_hash:
            return
        if b in self._stack_hash and self._stack_hash[b] != run.stack_hash:
            self.stack_changes.labels(b).inc()
        else:
            self.stack_changes.labels(b)  # export 0 from the first probe, so increase() works
        self._stack_hash[b] = run.stack_hash
        fingerprint = run.stack.get("response.system_fingerprint", "")
        labels = (
            b,
            *(
                bounded(v, self.label_length)
                for v in (
                    run.kind,
                    engine_version(run.kind, run.stack),
                    fingerprint,
                    run.stack.get("response.model", run.stack.get("request.model", "")),
                    run.stack_hash,
                )
            ),
        )
        old = self._stack_labels.get(b)
        if old is not None and old != labels:
            self.stack_info.remove(*old)
        self.stack_info.labels(*labels).set(1)
        self._stack_labels[b] = labels
