"""`canaryd run`: the long-running daemon.

APScheduler 3.x (stable; 4.x is still alpha) runs one job per configured schedule with ``coalesce``,
``max_instances=1`` (never two overlapping passes of a schedule), jitter and a misfire grace of half the
interval. Every pass probes, stores, compares and folds the results into the metrics served on the
configured listen address.

Signals: SIGTERM/SIGINT stop within the backends' longest ``timeout_s`` plus `STOP_GRACE_S`, whatever the
backends do: the stop event is shared with every backend's retry loop, so no attempt starts after it (the
canaries whose turn had not come are recorded as ``stopped``) and no backoff wait goes on; attempts in
flight end at their deadline, and the passes store what they got (each observation in one transaction, so
nothing is half-written) before the backends, the listener and the store close. SIGHUP reloads the
config — a new config that does not validate is logged and counted, and the old one keeps running.
systemd ``Type=notify``: READY once the store, the listener and the scheduler are up, WATCHDOG pings
while the scheduler thread lives.

Fleets: daemons sharing one PostgreSQL database claim each pass's backends first (`canaryd.store.leases`)
and probe only those they hold, so each backend is probed by one live daemon per interval; a pass still
working renews its leases (in a fleet, those of the backends that hash to it: `Tenure.keep`), and a clean
stop releases the leases.
Every pass logs ``pass.start``/``pass.done`` per backend, with counts.

Load: the passes' backends run on one pool of ``[daemon] max_in_flight`` threads, and every request holds
the daemon's `Gate` of as many slots (`canaryd.daemon.capacity`); a pass longer than its interval is
counted and logged with the backends that made it late.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import structlog
from apscheduler.events import EVENT_JOB_MAX_INSTANCES, EVENT_JOB_MISSED, JobExecutionEvent
from apscheduler.executors.pool import ThreadPoolExecutor as PassThreadPool
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.date import DateTrigger
from apscheduler.triggers.interval import IntervalTrigger

from canaryd.canaries import Canary
from canaryd.config import Config, ScheduleConfig, load_config
from canaryd.daemon import sdnotify, signals
from canaryd.daemon.capacity import Gate, affordable, overran
from canaryd.daemon.generation import Generation
from canaryd.daemon.httpserver import MetricsServer
from canaryd.daemon.metrics import Metrics
from canaryd.daemon.tenure import Tenure
from canaryd.daemon.webconfig import load_web_config
from canaryd.errors import InputError
from canaryd.probe.run import BackendRun, run_pass
from canaryd.store import open_store

log = structlog.get_logger("canaryd.daemon")

# Seconds a stop waits beyond the backends' longest timeout_s: for the passes to store what they got.
STOP_GRACE_S = 3.0
# A step back of the wall clock larger than this reschedules every job (see `Daemon._follow_clock`).
CLOCK_STEP_S = 1.0
# A standby asks for a backend this long after its lease was due to end, or after its holder's next pass
# when refused just before it (`Daemon._claim`): as the database counted them, measured from the answer.
TAKEOVER_DELAY_S = 0.1
# ... and this long before the holder's next pass is due: a killed holder's lease ends with its presence
# (`canaryd.store.leases`), so its pass is taken on time; a live holder's claim is refused, harmlessly.
TAKEOVER_EARLY_S = 0.25
# Passes that may run at once (each a thread waiting for its backends on the pool): APScheduler's default of
# 10 let a daemon that took a long pass's share (tens of takeover and phase passes) queue its regular pass
# behind them, which then counted as running and skipped its next turns.
PASS_THREADS = 64
TAKEOVER = "takeover:"  # the prefix of a takeover pass's job id
PHASE = "phase:"  # ... and of a pass that keeps backends probed too soon by a regular one on their own phase


def run_daemon(path: Path, stop: threading.Event) -> None:
    """`canaryd run`: load the config and serve until stopped (at once, if a stop came during start-up)."""
    config = load_config(path)
    if stop.is_set():
        log.info("stopped_before_start")
        return
    Daemon(path, config).serve_forever()


def trigger_for(s: ScheduleConfig) -> IntervalTrigger | CronTrigger:
    if s.cron is not None:  # from_crontab() takes no jitter, so spell the five fields out
        minute, hour, day, month, day_of_week = s.cron.split()
        return CronTrigger(
            minute=minute,
            hour=hour,
            day=day,
            month=month,
            day_of_week=day_of_week,
            timezone=UTC,
            jitter=int(s.jitter) or None,
        )
    return IntervalTrigger(seconds=s.every_s, timezone=UTC, jitter=int(s.jitter) or None)


class Daemon:
    def __init__(self, config_path: Path, config: Config) -> None:
        self.config_path = config_path
        self.config = config
        self.stop_event = threading.Event()
        self.reload_requested = threading.Event()
        self.metrics = Metrics(
            fingerprint_window_s=config.daemon.fingerprint_window, label_length=config.limits.label_length
        )
        self.store = open_store(config)
        self.gate = Gate(config.daemon.max_in_flight)  # every generation's backends share it
        self.metrics.requests_in_flight.set_function(lambda: self.gate.in_flight)
        self.pool = ThreadPoolExecutor(max_workers=config.daemon.max_in_flight, thread_name_prefix="backend")
        self.gen = Generation.build(config, self.stop_event, self.gate)
        self.tenure = Tenure(self.store, self.metrics)
        self._taken: dict[str, float] = {}  # backend -> when (monotonic) a takeover pass probed it
        self._led: dict[str, float] = {}  # ... and a regular pass of its lead schedule
        self._busy: set[str] = set()  # backends a pass of this daemon is probing now
        self._phased: set[str] = set()  # backends a phase pass of their own probes next (`_respace`)
        self._choosing = threading.Lock()
        self._in_flight = 0  # passes running, of any generation (what a stop waits for)
        self._idle = threading.Condition()
        self.scheduler = BackgroundScheduler(
            timezone=UTC,
            job_defaults={"coalesce": True, "max_instances": 1},
            executors={"default": PassThreadPool(PASS_THREADS)},
        )
        self.scheduler.add_listener(self._missed, EVENT_JOB_MISSED | EVENT_JOB_MAX_INSTANCES)
        self.httpd = None

    # -- probing ------------------------------------------------------------------------------------
    def _pass(self, schedule: str, takeover: tuple[str, ...] | None = None, phase: bool = False) -> None:
        """A pass of the schedule: of the backends this daemon holds, of those it takes over, or (``phase``)
        of those a regular pass found probed too recently (`_respace`)."""
        gen = self.gen
        begun = time.monotonic()
        gen.acquire()
        structlog.contextvars.bind_contextvars(schedule=schedule)  # job threads don't inherit context
        mine: set[str] = set()
        try:
            work = gen.work.get(schedule, {})
            if takeover is None:  # not one a phase pass probes (nor claims: its lease follows that phase)
                self.metrics.schedule_runs.labels(schedule).inc()
                with self._choosing:
                    work = {
                        b: cs for b, cs in work.items() if b not in self._phased or gen.lead[b] != schedule
                    }
            elif phase:
                work = {b: cs for b, cs in work.items() if b in takeover}
            else:  # not one a pass of this daemon took meanwhile: that pass's phase it is
                me = self.store.lease_holder
                work = {b: cs for b, cs in work.items() if b in takeover and self.tenure.holders.get(b) != me}
            held = self._claim(gen, list(work)) if work else set()
            mine = self._choose(gen, schedule, held, None if phase else takeover)
            chosen = {b: cs for b, cs in work.items() if b in mine}
            work = affordable(self.store, self.metrics, gen.config, schedule, chosen)
            work, early = self._still_held(gen, schedule, work)
            with self._choosing:  # what this pass will not probe is free now: its phase may come first
                self._busy -= mine - set(work)
                mine &= set(work)
            if early:
                self._respace(gen, schedule, early)
            if phase:
                self._rephase(gen, schedule, set(takeover or ()) - set(work) - set(early), set(work), begun)
            started: dict[str, float] = {}
            finished: dict[str, float] = {}
            futures = {
                b: self.pool.submit(self._timed, started, finished, gen, schedule, b, canaries)
                for b, canaries in work.items()
            }
            # each backend on its own: one that fails (probing, storing or recording) costs its own
            # series, and its canaries count as failed probes, so the failing-probes alert sees it
            self.tenure.keep(gen.lease_s, futures, lambda: self.gate.done, gen.plan)
            for b, f in futures.items():
                try:
                    run = f.result()
                    if run is None:  # its lease was lost before its worker started it
                        continue
                    self.metrics.record(run)
                    self.metrics.set_config_errors(b, len(gen.backends[b].refused))
                except Exception:
                    log.exception("backend_pass_failed", backend=b)
                    ids = [i for c in work[b] for i in c.observed_ids()]
                    try:
                        self.metrics.record_failed(b, ids)
                    except Exception:
                        log.exception("backend_pass_failed_unrecorded", backend=b)
            self.metrics.publish()  # the next scrape renders the pass, once; later ones serve it
            if takeover is None:
                self.metrics.schedule_last.labels(schedule).set(time.time())
            if takeover is None or phase:  # a phase pass carries a share of the schedule's work
                overran(self.metrics, self.gate, schedule, gen.interval_s[schedule], begun, started, finished)
        except Exception:
            log.exception("pass_failed")
            if phase:  # back to the regular passes
                with self._choosing:
                    self._phased -= set(takeover or ())
        finally:
            with self._choosing:
                self._busy -= mine
            structlog.contextvars.unbind_contextvars("schedule")
            gen.release()

    def _choose(
        self, gen: Generation, schedule: str, held: set[str], takeover: tuple[str, ...] | None
    ) -> set[str]:
        """Of the backends held, those this pass probes, decided under one lock: never one another pass
        of this daemon is probing (a takeover pass and a regular one can start together), and not a
        takeover of one that either probed less than half an interval ago (two probes in a row say nothing
        more; the next regular pass probes it). How soon after its last probe, whoever made it, a backend
        may be probed again is the lease's to say (`_still_held`)."""
        now = time.monotonic()
        recent = now - gen.interval_s.get(schedule, 0.0) / 2
        with self._choosing:
            chosen = held - self._busy
            if takeover is None:
                self._led.update(dict.fromkeys({b for b in chosen if gen.lead.get(b) == schedule}, now))
            else:
                last = {b: max(self._taken.get(b, -math.inf), self._led.get(b, -math.inf)) for b in chosen}
                chosen = {b for b in chosen if last[b] < recent}
                self._taken.update(dict.fromkeys(chosen, now))
            self._busy |= chosen
        return chosen

    def _still_held(
        self, gen: Generation, schedule: str, work: dict[str, list[Canary]]
    ) -> tuple[dict[str, list[Canary]], dict[str, float]]:
        """The backends still held as the pass sets out to probe them, marked so (`Store.start_probes`);
        one taken meanwhile is skipped, and none if the database does not answer (as a failed claim). One
        whose last probe (by this daemon's takeover, or by its previous holder) is less than its spacing
        ago is skipped too (returned with the seconds since), to be probed on that probe's phase
        (`_respace`): never twice in one interval."""
        if not work:
            return work, {}
        spacing = {b: gen.spacing_s[schedule] if gen.lead.get(b) == schedule else None for b in work}
        try:
            kept, early = self.store.start_probes(spacing)
        except Exception:
            log.exception("lease.claim_failed", backends=sorted(work))
            return {}, {}
        self.tenure.lose(set(work) - kept - set(early), "taken before its probe")
        return {b: cs for b, cs in work.items() if b in kept}, early

    def _respace(self, gen: Generation, schedule: str, early: dict[str, float]) -> None:
        """Backends probed too recently for this pass (seconds since): each is probed an interval after
        its last probe instead, by a pass of its own (`_rephase`), and so on every interval: the regular
        passes neither claim nor probe it meanwhile (a takeover's phase is its previous holder's)."""
        interval = gen.interval_s[schedule]
        # phases within half the spacing's slack share a pass: each is still probed more than its spacing
        # after its last probe, and a thousand backends taken from a long pass make tens of passes
        step = (interval - gen.spacing_s[schedule]) / 2
        self.metrics.schedule_respaced.labels(schedule).inc(len(early))
        with self._choosing:
            self._phased |= set(early)
        groups: dict[float, list[str]] = {}
        for b, age in early.items():  # age < spacing = interval - 2 × step: the wait is positive
            groups.setdefault(math.floor((interval - age) / step) * step, []).append(b)
        for wait, group in groups.items():
            log.debug("pass.respaced", schedule=schedule, backends=sorted(group), wait_s=wait)
            self._later(PHASE, schedule, group, wait, phase=True)

    def _rephase(
        self, gen: Generation, schedule: str, dropped: set[str], probed: set[str], begun: float
    ) -> None:
        """After a phase pass: the backends it probed are probed an interval from its start by the next; one
        it dropped (lost, over budget, a failed claim) goes back to the regular passes."""
        with self._choosing:
            self._phased -= dropped
        if probed:
            wait = max(gen.interval_s[schedule] - (time.monotonic() - begun), 0.0)
            self._later(PHASE, schedule, sorted(probed), wait, phase=True)

    def _timed(
        self,
        started: dict[str, float],
        finished: dict[str, float],
        gen: Generation,
        schedule: str,
        backend: str,
        canaries: list[Canary],
    ) -> BackendRun | None:
        """`_probe`, with when it started and finished (a failed one too): which backends made a pass late.
        None: the backend's lease was lost since the pass set out (or the database did not answer), and it
        is not probed. Its last probe is stamped as it starts (`Store.started_probe`), not as the pass
        set out: in a long pass the next probe is spaced from this one's actual start."""
        try:
            if not self.store.started_probe(backend, gen.lead.get(backend) == schedule):
                self.tenure.lose({backend}, "taken before its probe")
                return None
        except Exception:
            log.exception("lease.claim_failed", backends=[backend])
            return None
        started[backend] = time.monotonic()
        try:
            return self._probe(gen, schedule, backend, canaries)
        finally:
            finished[backend] = time.monotonic()

    def _probe(self, gen: Generation, schedule: str, backend: str, canaries: list[Canary]) -> BackendRun:
        """One backend's share of a pass, logged at its start and end with what it found."""
        log.info("pass.start", schedule=schedule, backend=backend, canaries=len(canaries))
        t0 = time.monotonic()
        (run,) = run_pass(gen.config, gen.backends, {backend: canaries}, self.store)
        down = {"unavailable": run.unavailable.kind.value} if run.unavailable else {}
        log.info(
            "pass.done",
            schedule=schedule,
            backend=backend,
            run_id=run.run_id,
            verdicts=dict(Counter(r.comparison.verdict.value for r in run.results)),
            duration_s=round(time.monotonic() - t0, 3),
            **down,
        )
        return run

    def _claim(self, gen: Generation, backends: list[str]) -> set[str]:
        """Claim the backends' leases; those this daemon holds. For each held elsewhere, a takeover pass
        is due just before the holder's next pass: if the holder was killed (its presence gone), this
        daemon probes the backend then, on the holder's schedule; if it is alive, that pass only claims,
        and asks again when the lease ends (a hung holder's backends are taken over then). Backends due
        at once (one holder's, of one schedule) share a takeover pass: one claim, as their holder's pass."""
        with self.metrics.batched():
            held, ends_in = self.tenure.claim(gen.lease_s, backends, gen.plan)
        if self.stop_event.is_set():
            return held
        groups: dict[tuple[str, float], list[str]] = {}
        for b, seconds in ends_in.items():
            due = seconds - (gen.lease_s[b] - gen.gap_s[b])  # the holder's next pass, without jitter
            if due > TAKEOVER_EARLY_S:
                wait = due - TAKEOVER_EARLY_S
            elif due > 0:  # refused just before the holder's pass: ask again right after it (if it died)
                wait = due + TAKEOVER_DELAY_S
            else:
                wait = seconds + TAKEOVER_DELAY_S
            groups.setdefault((gen.lead[b], math.floor(wait * 10) / 10), []).append(b)
        for (schedule, wait), group in groups.items():
            self._later(TAKEOVER, schedule, group, wait)
        return held

    def _later(self, prefix: str, schedule: str, group: list[str], wait: float, phase: bool = False) -> None:
        """A one-off pass of the schedule over the group's backends, in ``wait`` seconds."""
        job = prefix + schedule + ":" + ",".join(sorted(group))
        self.scheduler.add_job(
            self._job,
            DateTrigger(datetime.now(UTC) + timedelta(seconds=wait)),
            args=[schedule, tuple(sorted(group)), phase],
            id=job,
            name=job,
            misfire_grace_time=None,
            max_instances=2,  # the pass that set it may still be running when it is due
            replace_existing=True,
        )

    def _job(self, schedule: str, takeover: tuple[str, ...] | None = None, phase: bool = False) -> None:
        """A pass, counted so a stop knows what it waits for; none starts once stopping."""
        with self._idle:
            if self.stop_event.is_set():
                return
            self._in_flight += 1
        try:
            self._pass(schedule, takeover, phase)
        finally:
            with self._idle:
                self._in_flight -= 1
                self._idle.notify_all()

    def _follow_clock(self, offset: float) -> float:
        """Reschedule when the wall clock stepped back (NTP correcting it, a VM resumed from a snapshot):
        APScheduler waits for the wall-clock fire times it computed before the step, so a clock set back
        an hour would mean an hour without a pass. ``offset`` is the wall clock's lead on monotonic time
        at the last call; returns it now. (A step forward needs nothing: the next pass is simply due.)"""
        now = time.time() - time.monotonic()
        if now < offset - CLOCK_STEP_S:
            log.warning("clock_stepped_back", seconds=round(offset - now, 1))
            self._install(self.gen)  # interval schedules fire at once, then every interval from now
        return now

    def _missed(self, event: JobExecutionEvent) -> None:
        if event.job_id.startswith((TAKEOVER, PHASE)):  # still running: the next claim sets another
            return
        self.metrics.schedule_missed.labels(event.job_id).inc()
        log.warning("pass_skipped", schedule=event.job_id, code=event.code)

    def _install(self, gen: Generation) -> None:
        """Replace all jobs with the generation's schedules; interval schedules fire at once."""
        self.scheduler.remove_all_jobs()
        with self._choosing:
            self._phased.clear()  # their jobs are gone: the regular passes claim them again
        intervals = []
        for s in gen.config.schedules:
            self.metrics.schedule_overruns.labels(s.name)  # 0 from the start: an alert sees the first
            self.metrics.schedule_respaced.labels(s.name)
            self.scheduler.add_job(
                self._job,
                trigger_for(s),
                args=[s.name],
                id=s.name,
                name=s.name,
                misfire_grace_time=max(1, int(s.interval_s / 2)),
                next_run_time=datetime.now(UTC) if s.cron is None else None,
                replace_existing=True,
            )
            intervals += [
                (b, i, s.interval_s)
                for b, cs in gen.work[s.name].items()
                for c in cs
                for i in c.observed_ids()
            ]
        self.metrics.set_intervals(intervals)

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Listen, seed the metrics from the history, serve them, schedule, then READY. An address that
        cannot be listened on is a config error (exit 2)."""
        host, port = self.config.daemon.host_port
        web = self.config.daemon.web_config
        web = None if web is None else load_web_config(web)  # InputError (exit 2) naming the file and key
        try:
            self.httpd = MetricsServer((host, port), self.metrics, web=web)
        except OSError as e:
            why = e.strerror or str(e)
            raise InputError(
                f"{self.config.path}: daemon.listen {self.config.daemon.listen}: {why[:1].lower()}{why[1:]}"
            ) from None
        self._install(self.gen)
        self._restore_last_probes()  # before the first scrape: a restart's gap shows from it on
        threading.Thread(target=self.httpd.serve_forever, name="metrics-http", daemon=True).start()
        self.scheduler.start()
        log.info(
            "started",
            listen=self.config.daemon.listen,
            tls=web is not None and web.tls is not None,
            basic_auth=web is not None and bool(web.users),
            schedules=[s.name for s in self.config.schedules],
        )
        sdnotify.notify("READY=1", f"STATUS=probing {len(self.config.backends)} backend(s)")

    def _restore_last_probes(self) -> None:
        """Seed last-probe times from the history, so a restart's gap shows (and stale alerts span it), for
        the backends this daemon holds (a first claim): another daemon's backends are its to export."""
        pairs = self.gen.work_pairs()
        held = self._claim(self.gen, list(pairs))
        for backend, canaries in pairs.items():
            if backend not in held:
                continue
            for canary in canaries:
                rows = self.store.observations(
                    backend=backend, canary_id=canary, instance=self.store.instance, limit=1
                )
                if rows:
                    t = rows[0].started_at
                    self.metrics.set_last_probe(
                        backend, canary, (t if t.tzinfo else t.replace(tzinfo=UTC)).timestamp()
                    )
        self.metrics.publish()

    def reload(self) -> bool:
        """Re-read the config; keep the old one running if the new one is invalid."""
        self.metrics.reloads.inc()
        sdnotify.reloading()
        try:
            config = load_config(self.config_path)
            gen = Generation.build(config, self.stop_event, self.gate)
        except InputError as e:
            self.metrics.reload_failures.inc()
            log.error("reload_rejected", error=str(e))
            sdnotify.notify("READY=1", "STATUS=reload rejected; previous config still running")
            return False
        for what in ("storage_url", "daemon"):
            if getattr(config, what) != getattr(self.config, what):
                log.warning("reload_needs_restart", setting=what)
        old, self.gen, self.config = self.gen, gen, config
        for b in set(gen.backends) & {b for b, g in old.backends.items() if g.refused}:
            self.metrics.set_config_errors(b, 0)  # the new generation re-sends what the old one held back
        self._install(gen)
        self.tenure.forget(set(old.work_pairs()) - set(gen.work_pairs()))
        old.retire()
        log.info("reloaded", schedules=[s.name for s in config.schedules])
        sdnotify.notify("READY=1", f"STATUS=probing {len(config.backends)} backend(s)")
        return True

    def stop(self) -> bool:
        """Stop within the longest ``timeout_s`` plus `STOP_GRACE_S`; False if a pass was still running
        then (a kind that ignores its deadline): its backends and the store are left open to the exit."""
        self.stop_event.set()  # no attempt starts, backoff waits end (the backends share this event)
        sdnotify.notify("STOPPING=1")
        log.info("stopping")
        if self.scheduler.running:
            self.scheduler.shutdown(wait=False)  # no new pass; the running ones are waited for below
        bound = max((b.timeout_s for b in self.config.backends), default=0.0) + STOP_GRACE_S
        with self._idle:
            done = self._idle.wait_for(lambda: self._in_flight == 0, timeout=bound)
        if done:
            self.pool.shutdown(wait=False)  # idle: every pass is done
            self.gen.retire()
            try:  # the fleet's other daemons take these backends over at their next pass, not at expiry
                released = self.store.release_leases()
                if released:
                    log.info("lease.released", leases=released)
            except Exception:
                log.exception("lease.release_failed")
        # else the passes still probing keep their leases until they expire: no second daemon joins them
        if self.httpd is not None:
            self.httpd.shutdown()
        if not done:
            log.error("stop_abandoned", passes=self._in_flight, waited_s=round(bound, 1))
            return False
        self.store.close()
        log.info("stopped")
        return True

    def serve_forever(self) -> None:
        """Main thread: signals, reloads and watchdog pings until SIGTERM/SIGINT.

        The signals are this daemon's from here on, with any that came during start-up (`signals`): a stop
        requested before the listener and the scheduler are up closes what was built and starts nothing.
        """
        signals.install(self.stop_event, self.reload_requested)
        if self.stop_event.is_set():
            log.info("stopped_before_start")
            self.stop()
            return
        self.start()
        period, last_ping = sdnotify.watchdog_period(), 0.0
        offset = time.time() - time.monotonic()
        try:
            while not self.stop_event.wait(min(period or 1.0, 1.0)):
                offset = self._follow_clock(offset)
                if self.reload_requested.is_set():
                    self.reload_requested.clear()
                    self.reload()
                if period is not None and self.scheduler.running and time.monotonic() - last_ping >= period:
                    sdnotify.notify("WATCHDOG=1")
                    last_ping = time.monotonic()
        finally:
            if not self.stop():
                # A pass ignored its deadline (nothing an HTTP kind does): end the process anyway, as
                # promised. What was committed is kept; a transaction still open is rolled back whole.
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
