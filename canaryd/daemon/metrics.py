"""Prometheus metrics: what the last probe of every canary × backend said, and the stacks behind them.

canaryd is directly instrumented (it probes on its own schedule; a scrape never triggers a probe). The
layout is lean, in the economy of blackbox_exporter's ``probe_*`` series: four gauges at most per
canary × backend (the current verdict, success, the largest logprob move, the last-probe time) and
everything else per backend (latency as one histogram, probe counts, the stack). History (every answer,
every verdict, every p-value) is in the database, not in series: at 10,000 canary × backend pairs this is
about 40,000 series instead of 300,000 (``bench/metrics_bench.py``).

Every family is declared once, in `canaryd.daemon.metric_table`: this module creates them from it and
removes a backend's series by it.

The exposition is rendered at most once per probe pass (`Metrics.publish`, which the daemon calls after
recording a pass, marks it due; the first scrape after renders it) and the metrics server returns those
cached bytes (`Metrics.exposition`); only canaryd's own few series (process, build, schedules, reloads)
are rendered on each scrape. ``registry`` still holds every series, for tests and tools that read samples
one by one.

Labels are bounded: ``backend`` and ``canary`` come from the config, ``verdict`` and ``reason`` are
enums, and free text (answers, errors, prompts) never becomes a label. The stack ``_info`` series carries
the few identity strings a dashboard needs (engine version, fingerprint, model, stack hash), one series
per backend at a time, each cut to ``label_length`` characters (`bounded`: a server's 1 MB fingerprint is
a label of 128; the full value stays in the database).
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics

from canaryd import __version__
from canaryd.backends import engine_version
from canaryd.daemon.exposition import (
    EMPTY,
    EOF,
    Cache,
    Pair,
    Tail,
    bounded,
    digest,
    escape,
    render_pairs,
)
from canaryd.daemon.metric_table import METRICS, PAIR_FAMILIES, LeaseLoss, Scope
from canaryd.judge.compare import Verdict
from canaryd.judge.stats import DetectorState
from canaryd.observation import ErrorKind
from canaryd.probe.run import BackendRun
from canaryd.stack import configuration_of

_TYPES = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}
# The pair families go with their pairs (``_pairs``); these are removed series by series.
_PER_BACKEND = tuple(m for m in METRICS if m.per_backend and m.scope is not Scope.PAIR)


class _PairCollector:
    """The pair families for ``Metrics.registry`` (samples read one by one; the server uses the cache)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        pairs = self.metrics._snapshot()
        for f in PAIR_FAMILIES:
            fam = GaugeMetricFamily(f.name, f.help, labels=f.labels)
            for p in pairs:
                v = getattr(p, f.attr)
                if v is None:
                    continue
                if f.attr == "verdict":
                    fam.add_metric((p.backend, p.canary, v), 1)
                else:
                    fam.add_metric((p.backend, p.canary), v)
            yield fam


class Metrics:
    """Every series canaryd exports, on registries of its own (no global state). Each family of
    `metric_table.METRICS` but the pair families (held in ``_pairs``) is the attribute its row names."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        fingerprint_window_s: float = 3600.0,
        label_length: int = 128,
    ) -> None:
        disable_created_metrics()  # the *_created series double the output and no alert or panel needs them
        self.registry = registry or CollectorRegistry()  # every series
        self._live = CollectorRegistry()  # canaryd's own: rendered on each scrape (cheap)
        self._per_pass = CollectorRegistry()  # per backend: rendered by publish() with the pairs
        self.fingerprint_window_s = fingerprint_window_s
        self.label_length = label_length
        self._lock = threading.RLock()  # passes of several schedules record at once
        self._publishing = threading.Lock()  # publishes in turn: a slow one never replaces a newer cache
        self._pairs: dict[tuple[str, str], Pair] = {}
        self._cache = EMPTY
        self._due = False  # a publish since the last render (`_rendered`)
        live, per_pass = self._live, self._per_pass

        self._add(live, ProcessCollector(registry=None))  # process_resident_memory_bytes & co
        self._add(live, PlatformCollector(registry=None))
        for m in METRICS:  # in the table's order, which is the exposition's
            if m.scope is not Scope.PAIR:
                kwargs = {"buckets": m.buckets} if m.buckets else {}
                metric = _TYPES[m.type](m.name, m.help, m.labels, registry=None, **kwargs)
                setattr(self, m.attr, self._add(live if m.scope is Scope.LIVE else per_pass, metric))
        self.build_info.labels(__version__, sys.version.split()[0]).set(1)
        self.registry.register(_PairCollector(self))
        self._backends: set[str] = set()
        self._expected: set[tuple[str, str]] | None = None  # the configured pairs, once `set_intervals` ran
        self._stack_labels: dict[str, tuple[str, ...]] = {}
        self._stack_hash: dict[str, str] = {}
        self._fingerprints: dict[str, deque[tuple[float, str]]] = {}
        self._configurations: dict[str, deque[tuple[float, str]]] = {}
        self._lease: dict[str, bool] = {}
        self._batch = threading.local()  # `batched`: its depth in this thread, and whether a publish is due

    def _add(self, registry: CollectorRegistry, collector):
        """``collector`` on ``registry`` (live or per pass) and on ``self.registry`` (every series)."""
        registry.register(collector)
        self.registry.register(collector)
        return collector

    def _pair(self, backend: str, canary: str) -> Pair:
        p = self._pairs.get((backend, canary))
        if p is None:
            labels = f'backend="{escape(backend)}",canary="{escape(canary)}"'
            p = self._pairs[(backend, canary)] = Pair(backend, canary, labels)
        return p

    def _snapshot(self) -> list[Pair]:
        with self._lock:
            return [
                Pair(p.backend, p.canary, p.labels, p.verdict, p.success, p.delta, p.last_probe)
                for p in self._pairs.values()
            ]

    # -- what the daemon tells ------------------------------------------------------------------------
    def set_intervals(self, intervals: Iterable[tuple[str, str, float]]) -> None:
        """Expected seconds between probes (the longest per backend is exported); canaries × backends not
        listed any more lose their series. Publishes: a reload shows at once."""
        intervals = list(intervals)
        keep = {(b, c) for b, c, _ in intervals}
        longest: dict[str, float] = {}
        for b, _, seconds in intervals:
            longest[b] = max(seconds, longest.get(b, 0.0))
        with self._lock:
            for key in set(self._pairs) - keep:
                del self._pairs[key]
            self._expected = keep
            for b in self._backends - set(longest):
                for m in _PER_BACKEND:
                    getattr(self, m.attr).remove_by_labels({"backend": b})
                for state in (
                    self._stack_labels,
                    self._stack_hash,
                    self._fingerprints,
                    self._configurations,
                    self._lease,
                ):
                    state.pop(b, None)
            self._backends = set(longest)
            for b, seconds in longest.items():
                self.interval.labels(b).set(seconds)
                if b in self._lease:
                    self.lease_held.labels(b).set(1 if self._lease[b] else 0)
        self.publish()

    def set_last_probe(self, backend: str, canary: str, timestamp: float) -> None:
        """The last probe's time from the history (a restart's gap shows; call `publish` after seeding)."""
        with self._lock:
            self._pair(backend, canary).last_probe = timestamp

    def set_lease(self, backend: str, held: bool) -> None:
        """Whether this daemon probes ``backend`` (its fleet lease; always on SQLite). One that does not
        drops the backend's series the table marks `LeaseLoss.DROP` (its pairs, stack, detector,
        reachability, …), so that neither a verdict it no longer renews nor an ageing last-probe time
        stands for the backend: the holder exports them. Counters, the histogram, the interval and the
        lease (now 0) stay. A change, or a drop, publishes at once."""
        with self._lock:
            # a drop shows at once even unchanged: a pass may have recorded the backend since it was lost
            changed = self._lease.get(backend) is not held or not held
            self._lease[backend] = held
            if not held:
                for key in [k for k in self._pairs if k[0] == backend]:
                    del self._pairs[key]
                for m in _PER_BACKEND:
                    if m.lease_loss is LeaseLoss.DROP:
                        getattr(self, m.attr).remove_by_labels({"backend": backend})
                for state in (self._stack_labels, self._stack_hash, self._fingerprints, self._configurations):
                    state.pop(backend, None)
            self.lease_held.labels(backend).set(1 if held else 0)
        if changed and getattr(self._batch, "depth", 0):
            self._batch.due = True
        elif changed:
            self.publish()

    @contextmanager
    def batched(self) -> Iterator[None]:
        """This thread's lease changes within publish once, at the end: a claim of a thousand backends
        renders the exposition once, not once per backend (another thread's change publishes at once)."""
        batch = self._batch
        batch.depth = getattr(batch, "depth", 0) + 1
        try:
            yield
        finally:
            batch.depth -= 1
            if batch.depth == 0 and getattr(batch, "due", False):
                batch.due = False
                self.publish()

    def set_config_errors(self, backend: str, refused: int) -> None:
        """How many of the backend's canaries it refused as configured (and are not re-sent)."""
        with self._lock:
            if self._configured(backend):
                self.config_errors.labels(backend).set(refused)

    def record_failed(
        self, backend: str, canary_ids: Iterable[str], reason: ErrorKind = ErrorKind.INTERNAL
    ) -> None:
        """A backend's pass that produced no results to record (canaryd failed at it): each canary's last
        probe is a failure of ``reason``, so the failing-probes alert sees it like any other failure. The
        last-probe times stay: nothing was recorded, and the staleness alert should see that too."""
        with self._lock:
            for c in canary_ids:
                if not self._configured(backend, c):
                    continue
                p = self._pair(backend, c)
                p.verdict, p.success = Verdict.ERROR.value, 0.0
                self.failures.labels(backend, reason.value).inc()

    def record(self, run: BackendRun, now: float | None = None) -> None:
        """Fold one backend's probe pass into the series (shown by the next `publish`)."""
        now = time.time() if now is None else now
        with self._lock:
            self._record(run, now)

    def _configured(self, backend: str, canary: str | None = None) -> bool:
        """Whether the config still has the backend (and the canary): a pass the old config started
        records after a reload dropped them, and must not bring their series back for good."""
        if self._expected is None:  # no config given (a bare registry): everything recorded is shown
            return True
        return backend in self._backends if canary is None else (backend, canary) in self._expected

    def _record(self, run: BackendRun, now: float) -> None:
        b = run.backend
        if not self._configured(b):
            return
        stopped = ErrorKind.STOPPED  # not sent because canaryd was stopping: says nothing of the backend
        if run.unavailable is None or run.unavailable.kind is not stopped:
            self.reachable.labels(b).set(0 if run.unavailable else 1)
        self.probes.labels(b)  # export 0 from the first pass, so increase() works
        self.tokens.labels(b).inc(
            sum(
                (r.observation.prompt_tokens or 0) + (r.observation.completion_tokens or 0)
                for r in run.results
            )
        )
        self.budget_skips.labels(b)
        self.config_errors.labels(b)  # 0 until the daemon counts a refusal (`set_config_errors`)
        self.new_configurations.labels(b)
        for res in run.results:
            obs, cmp = res.observation, res.comparison
            if obs.error_kind is stopped or not self._configured(b, obs.canary_id):
                continue
            p = self._pair(b, obs.canary_id)
            p.verdict, p.last_probe, p.success = cmp.verdict.value, now, 1.0 if obs.ok else 0.0
            self.probes.labels(b).inc()
            if obs.attempts > 1:
                self.retries.labels(b).inc(obs.attempts - 1)
            if not obs.ok:
                self.failures.labels(b, (obs.error_kind or ErrorKind.INTERNAL).value).inc()
                continue
            self.duration.labels(b).observe(obs.latency_s)
            d = cmp.delta
            if cmp.basis == "text":  # no logprobs moved or not: no series, not a 0 that reads "none moved"
                p.delta = None
            elif d is not None:
                p.delta = max(d.max_abs_dlogprob or 0.0, d.max_abs_dtop or 0.0)
            elif cmp.verdict is Verdict.BASELINE:
                p.delta = 0.0
            if obs.system_fingerprint:  # by digest: a window of 1 MB fingerprints must not fill memory
                self._fingerprints.setdefault(b, deque()).append((now, digest(obs.system_fingerprint)))
            if configuration := configuration_of(obs.stack):
                self._configurations.setdefault(b, deque()).append((now, configuration))
            if cmp.verdict is Verdict.NEW_CONFIG:
                self.new_configurations.labels(b).inc()
        if not run.unavailable:  # an unreachable backend keeps its last evidence
            on_text = {
                r.observation.canary_id
                for r in run.results
                if r.observation.ok and r.comparison.basis == "text"
            }
            self.text_basis.labels(b).set(len(on_text))
            self.learning.labels(b).set(len(run.learning))
            state = run.detector or DetectorState()
            self.e_cusum.labels(b).set(state.statistic)
            self.alarm.labels(b).set(1 if state.alarm else 0)
            parting = run.reference.max_parting_nats if run.reference is not None else None
            if parting is not None:
                self.reference_divergence.labels(b).set(parting)
        self._record_stack(run, now)

    def _record_stack(self, run: BackendRun, now: float) -> None:
        b = run.backend
        # The window is elapsed time. A stamp ahead of ``now`` (the wall clock went back) counts as seen
        # now: it ages out a window from here, not when the clock catches up with it, and it cannot hold
        # the stamps behind it in the window (nor grow it) meanwhile.
        cutoff = now - self.fingerprint_window_s
        for state, gauge in (
            (self._fingerprints, self.fingerprints),
            (self._configurations, self.configurations),
        ):
            seen = deque((min(t, now), v) for t, v in state.get(b, ()) if t >= cutoff)
            state[b] = seen
            gauge.labels(b).set(len({v for _, v in seen}))
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

    # -- the exposition -------------------------------------------------------------------------------
    def publish(self) -> None:
        """What the passes recorded is ready to show: the next scrape renders it, once, for every scrape
        until the next publish. Rendering at the scrape, not here, bounds the renders by the scrapes: a
        daemon of a thousand backends ends tens of passes a minute (takeovers, phases), and a render at
        each cost it a third of its CPU."""
        self._due = True

    def _rendered(self) -> Cache:
        """The cache, rendered first if a publish came since the last render."""
        if self._due:
            with self._publishing:
                if self._due:
                    self._due = False  # before the render: a publish during it renders again next time
                    try:
                        with self._lock:  # recording waits only for the render, not for the compression
                            pairs = render_pairs(self._pairs.values())
                            text = generate_latest(self._per_pass)
                            om = openmetrics.generate_latest(self._per_pass)[: -len(EOF)]
                    except BaseException:
                        self._due = True  # still due: the next scrape tries again
                        raise
                    # one assignment: a scrape sees the old cache or the new one, whole
                    self._cache = Cache(Tail.of(text + pairs), Tail.of(om + pairs + EOF))
        return self._cache

    def exposition(self, accept: str = "", gzipped: bool = False) -> tuple[bytes, str]:
        """The body of a scrape and its content type: canaryd's own series rendered now, then the cached
        pass. OpenMetrics if the scraper accepts it (as Prometheus does), else the text format 0.0.4."""
        cache = self._rendered()
        if "application/openmetrics-text" in accept:
            live = openmetrics.generate_latest(self._live)[: -len(EOF)]
            return cache.openmetrics.after(live, gzipped), openmetrics.CONTENT_TYPE_LATEST
        return cache.text.after(generate_latest(self._live), gzipped), CONTENT_TYPE_PLAIN_0_0_4
